"""Command-line flags for a service's configuration dataclass, each also readable from an
environment variable (``<PREFIX><FIELD>``, so compose files and manifests can set it).

Nested dataclass fields (``limits: ServerLimits``, ``security: ServerSecurity``, a client's
``ClientSecurity``) become flags of their own, named after their fields, with the
``flag_prefix`` of the field's metadata in front. Secret fields (``ENV_ONLY`` metadata) are
read from their environment variable only: flags show in process lists.

Parsed once, in the service's ``main``; nothing reads the environment at import time.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import field, fields, is_dataclass
from typing import TypeVar

C = TypeVar("C")


def flag(default, help: str):
    """A configuration field that is also a flag: its default and its one help text."""
    return field(default=default, metadata={"help": help})


def _flat_fields(config) -> list[tuple[str, str | None, str, object, str]]:
    """(flag name, nested field or None, field name, default, help) of every field that has a
    flag. A nested field's ``no_flags`` metadata names its fields a service does not use."""
    out = []
    for f in fields(config):
        value = getattr(config, f.name)
        if not is_dataclass(value):
            out.append((f.name, None, f.name, value, f.metadata["help"]))
            continue
        prefix = f.metadata.get("flag_prefix", "")
        for sub in fields(value):
            if not sub.metadata.get("env_only") and sub.name not in f.metadata.get("no_flags", ()):
                out.append(
                    (
                        prefix + sub.name,
                        f.name,
                        sub.name,
                        getattr(value, sub.name),
                        sub.metadata["help"],
                    )
                )
    return out


def _secret_fields(config) -> list[tuple[str, str, str]]:
    """(environment name without the prefix, nested field, field name) of every secret."""
    out = []
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            prefix = f.metadata.get("flag_prefix", "")
            out += [
                ((prefix + sub.name).upper(), f.name, sub.name)
                for sub in fields(value)
                if sub.metadata.get("env_only")
            ]
    return out


def parse_service_config(
    config_class: type[C],
    *,
    prog: str,
    description: str,
    env_prefix: str,
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> C:
    """Build ``config_class`` (a dataclass whose defaults build it, nested dataclasses
    included) from flags, which override environment variables, which override the defaults.
    Each flag's help is its field's (``flag``)."""
    env = os.environ if env is None else env
    # No abbreviations: "--auth-token SECRET" must not pass for --auth-token-file.
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    defaults = config_class()
    flat = _flat_fields(defaults)
    for name, _, _, default, text in flat:
        flag = "--" + name.replace("_", "-")
        raw = env.get(env_prefix + name.upper())
        if isinstance(default, bool):
            value = default if raw is None else raw.lower() in ("1", "true", "yes", "on")
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=value, help=text
            )
        else:
            try:
                value = default if raw is None else type(default)(raw)
            except ValueError:
                parser.error(
                    f"{env_prefix}{name.upper()}={raw!r} is not a {type(default).__name__}"
                )
            parser.add_argument(
                flag, type=type(default), default=value, help=f"{text} (default {default!r})"
            )
    args = vars(parser.parse_args(argv))
    values = {name: args[name] for name, nested, *_ in flat if nested is None}
    secrets: dict[str, dict[str, str]] = {}
    for env_name, nested, sub in _secret_fields(defaults):
        if env.get(env_prefix + env_name):
            secrets.setdefault(nested, {})[sub] = env[env_prefix + env_name]
    try:
        for f in fields(defaults):
            value = getattr(defaults, f.name)
            if is_dataclass(value):
                given = {sub: args[n] for n, nested, sub, *_ in flat if nested == f.name}
                values[f.name] = type(value)(**given, **secrets.get(f.name, {}))
        return config_class(**values)
    except ValueError as exc:
        parser.error(str(exc))
