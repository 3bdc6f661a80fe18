"""Command-line flags for a service's configuration dataclass, each also readable from an
environment variable (``<PREFIX><FIELD>``, so compose files and manifests can set it).

Parsed once, in the service's ``main``; nothing reads the environment at import time.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import TypeVar

from routereplay.grpc_server import ServerLimits

LIMITS_HELP = {
    "max_message_bytes": "largest gRPC message",
    "max_concurrent_rpcs": "in-flight calls before RESOURCE_EXHAUSTED",
    "max_concurrent_streams": "HTTP/2 streams per connection",
    "workers": "handler threads",
}

C = TypeVar("C")


def parse_service_config(
    config_class: type[C],
    help: Mapping[str, str],
    *,
    prog: str,
    description: str,
    env_prefix: str,
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> C:
    """Build ``config_class`` (a dataclass with a ``limits: ServerLimits`` field) from flags,
    which override environment variables, which override the defaults.

    Args:
        help: one line per field of ``config_class`` (``LIMITS_HELP`` covers the limits).
    """
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog=prog, description=description)
    limits = config_class().limits
    defaults = {f.name: f.default for f in fields(config_class) if f.name != "limits"}
    defaults.update({f.name: getattr(limits, f.name) for f in fields(ServerLimits)})
    helps = {**LIMITS_HELP, **help}
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        raw = env.get(env_prefix + name.upper())
        if isinstance(default, bool):
            value = default if raw is None else raw.lower() in ("1", "true", "yes", "on")
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=value, help=helps[name]
            )
        else:
            try:
                value = default if raw is None else type(default)(raw)
            except ValueError:
                parser.error(
                    f"{env_prefix}{name.upper()}={raw!r} is not a {type(default).__name__}"
                )
            parser.add_argument(
                flag, type=type(default), default=value, help=f"{helps[name]} (default {default!r})"
            )
    args = vars(parser.parse_args(argv))
    limits = ServerLimits(**{f.name: args.pop(f.name) for f in fields(ServerLimits)})
    try:
        return config_class(**args, limits=limits)
    except ValueError as exc:
        parser.error(str(exc))
