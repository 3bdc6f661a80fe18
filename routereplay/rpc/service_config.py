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
from dataclasses import fields, is_dataclass
from typing import TypeVar

from routereplay.rpc.grpc_server import ServerLimits
from routereplay.rpc.metrics import METRICS_HELP, MetricsConfig
from routereplay.rpc.security import ClientSecurity, ServerSecurity

LIMITS_HELP = {
    "max_message_bytes": "largest gRPC message",
    "max_concurrent_rpcs": "in-flight calls before RESOURCE_EXHAUSTED",
    "max_concurrent_streams": "HTTP/2 streams per connection",
    "workers": "handler threads",
    "max_connection_age_s": "seconds before a client is asked to reconnect (0: never)",
    "max_connection_age_grace_s": "seconds calls may finish on a connection past its age",
}
SERVER_SECURITY_HELP = {
    "tls_cert_file": "PEM certificate chain of this server; with tls_key_file: TLS only",
    "tls_key_file": "PEM private key of this server",
    "tls_client_ca_file": "PEM CA of client certificates: mutual TLS (needs tls_cert_file)",
    "auth_token_file": "file holding the bearer token calls must send (health needs none)",
}
CLIENT_SECURITY_HELP = {
    "tls": "speak TLS (the system's roots unless ca_file is set)",
    "ca_file": "PEM CA that signed the server's certificate (turns TLS on)",
    "cert_file": "PEM client certificate, for mutual TLS",
    "key_file": "PEM client private key, for mutual TLS",
    "token_file": "file holding the bearer token to send",
}
_NESTED_HELP = {
    ServerLimits: LIMITS_HELP,
    ServerSecurity: SERVER_SECURITY_HELP,
    ClientSecurity: CLIENT_SECURITY_HELP,
    MetricsConfig: METRICS_HELP,
}

C = TypeVar("C")


def _flat_fields(config) -> list[tuple[str, str | None, str, object, Mapping[str, str]]]:
    """(flag name, nested field or None, field name, default, the nested class's help) of
    every field that has a flag."""
    out = []
    for f in fields(config):
        value = getattr(config, f.name)
        if not is_dataclass(value):
            out.append((f.name, None, f.name, value, {}))
            continue
        prefix = f.metadata.get("flag_prefix", "")
        for sub in fields(value):
            if not sub.metadata.get("env_only"):
                nested_help = _NESTED_HELP.get(type(value), {})
                out.append((prefix + sub.name, f.name, sub.name, getattr(value, sub.name),
                            nested_help))  # fmt: skip
    return out


def _secret_fields(config) -> list[tuple[str, str, str]]:
    """(environment name without the prefix, nested field, field name) of every secret."""
    out = []
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            prefix = f.metadata.get("flag_prefix", "")
            out += [((prefix + sub.name).upper(), f.name, sub.name)
                    for sub in fields(value) if sub.metadata.get("env_only")]  # fmt: skip
    return out


def env_names(config_class, env_prefix: str) -> set[str]:
    """Every environment variable ``parse_service_config`` reads for ``config_class``."""
    defaults = config_class()
    names = [name.upper() for name, *_ in _flat_fields(defaults)]
    names += [name for name, *_ in _secret_fields(defaults)]
    return {env_prefix + name for name in names}


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
    """Build ``config_class`` (a dataclass whose defaults build it, nested dataclasses
    included) from flags, which override environment variables, which override the defaults.

    Args:
        help: one line per field of ``config_class``; the nested classes bring their own
            (``LIMITS_HELP``, ...), which ``help`` may override by flag name.
    """
    env = os.environ if env is None else env
    # No abbreviations: "--auth-token SECRET" must not pass for --auth-token-file.
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    defaults = config_class()
    flat = _flat_fields(defaults)
    for name, _, field_name, default, nested_help in flat:
        text = help.get(name) or nested_help[field_name]
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
