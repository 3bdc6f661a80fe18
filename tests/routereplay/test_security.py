"""Security settings and plumbing shared by the services: the flags and environment variables,
secrets kept out of reprs and messages, the development certificates, and the asyncio
server's token check and request parsing over a real socket."""

from __future__ import annotations

import asyncio
import stat

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_server.config import parse_config as parse_rollout_config
from route_cache.config import parse_config as parse_cache_config
from routereplay.dev import devcerts
from routereplay.rpc.grpc_server import ServerLimits, make_aio_server, set_serving_aio
from routereplay.rpc.security import (
    MISSING_TOKEN,
    ClientSecurity,
    ServerSecurity,
    add_port,
    read_secret,
    secure_aio_channel,
)

SECRET = "do-not-show-me"


def test_server_security_from_flags_and_environment(tmp_path):
    env = {
        "ROUTE_CACHE_TLS_CERT_FILE": "/certs/server.pem",
        "ROUTE_CACHE_TLS_KEY_FILE": "/certs/server-key.pem",
        "ROUTE_CACHE_AUTH_TOKEN": SECRET,
        "ROUTE_CACHE_REDIS_PASSWORD": SECRET,
    }
    config = parse_cache_config(["--tls-client-ca-file", "/certs/ca.pem"], env=env)
    assert config.security == ServerSecurity(
        "/certs/server.pem", "/certs/server-key.pem", "/certs/ca.pem", auth_token=SECRET
    )
    assert config.redis.password == SECRET
    assert SECRET not in repr(config) and SECRET not in str(config)


def test_secrets_are_never_flags(capsys):
    for flag in ("--auth-token", "--redis-password"):
        with pytest.raises(SystemExit):
            parse_cache_config([flag, SECRET], env={})
        assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_rollout_config(["--route-cache-token", SECRET], env={})
    assert "unrecognized arguments" in capsys.readouterr().err


def test_rollout_server_reaches_the_route_cache_with_its_own_settings():
    env = {"ROLLOUT_SERVER_ROUTE_CACHE_TOKEN": SECRET}
    config = parse_rollout_config(
        [
            "--route-cache-ca-file",
            "/certs/ca.pem",
            "--route-cache-cert-file",
            "/c.pem",
            "--route-cache-key-file",
            "/k.pem",
            "--auth-token-file",
            "/run/secrets/token",
        ],
        env=env,
    )
    assert config.route_cache_security == ClientSecurity(
        ca_file="/certs/ca.pem", cert_file="/c.pem", key_file="/k.pem", token=SECRET
    )
    assert config.route_cache_security.uses_tls
    assert config.security.auth_token_file == "/run/secrets/token"
    assert SECRET not in repr(config)


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--tls-cert-file", "c.pem"], {}, "tls_cert_file and tls_key_file go together"),
        (["--tls-client-ca-file", "ca.pem"], {}, "needs tls_cert_file"),
        (["--auth-token-file", "t"], {"ROUTE_CACHE_AUTH_TOKEN": SECRET}, "not both"),
        (["--redis-tls-ca-file", "ca.pem"], {}, "need a rediss:// redis_url"),
        (["--max-write-chunks", "0"], {}, "max_write_chunks must be >= 1"),
    ],
)
def test_bad_settings_are_named(argv, env, message, capsys):
    with pytest.raises(SystemExit):
        parse_cache_config(argv, env=env)
    err = capsys.readouterr().err
    assert message in err and SECRET not in err


def test_secret_files(tmp_path):
    path = tmp_path / "token"
    path.write_text(SECRET + "\n")
    assert read_secret(str(path), "token file") == SECRET.encode()
    assert ClientSecurity(token_file=str(path)).metadata() == (
        ("authorization", f"Bearer {SECRET}"),
    )
    assert ClientSecurity().metadata() == ()
    path.write_text("\n")
    with pytest.raises(ValueError, match="token file .* is empty"):
        read_secret(str(path), "token file")
    with pytest.raises(ValueError, match="cannot read auth_token file '/no/such/file'"):
        ServerSecurity(auth_token_file="/no/such/file").token()
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        ClientSecurity(cert_file="c.pem")


def test_dev_certificates(tmp_path):
    assert devcerts.main([str(tmp_path)]) == 0
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    client = x509.load_pem_x509_certificate((tmp_path / "client.pem").read_bytes())
    for cert in (server, client):
        cert.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "route-cache", "rollout-server"} <= set(
        sans.get_values_for_type(x509.DNSName)
    )
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    for key in ("ca-key.pem", "server-key.pem", "client-key.pem"):
        assert stat.S_IMODE((tmp_path / key).stat().st_mode) == 0o600
    assert devcerts.main([]) == 2


GARBAGE = b"\x0a\xff\x01garbage"


def test_aio_server_token_and_garbage(tmp_path):
    """An asyncio server from ``make_aio_server`` (the rollout server's) with TLS and a token:
    health answers without the token, reflection needs it, and 100 undecodable requests on
    one channel are each INVALID_ARGUMENT, with the channel still serving after them."""
    devcerts.generate(tmp_path)
    security = ServerSecurity(
        str(tmp_path / "server.pem"), str(tmp_path / "server-key.pem"), auth_token=SECRET
    )
    tls = ClientSecurity(ca_file=str(tmp_path / "ca.pem"))

    async def main():
        server, health = await make_aio_server(ServerLimits(), ["test.Service"], security)
        port = add_port(server, "127.0.0.1:0", security)
        await server.start()
        await set_serving_aio(health, ["test.Service"], True)
        try:
            async with secure_aio_channel(f"127.0.0.1:{port}", tls) as channel:
                check = health_pb2_grpc.HealthStub(channel).Check
                reply = await check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                raw = channel.unary_unary("/grpc.health.v1.Health/Check")
                for _ in range(100):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await raw(GARBAGE, timeout=5)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert info.value.details().startswith(
                        "request is not a valid grpc.health.v1.HealthCheckRequest: "
                    )
                reply = await check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                reflection = channel.stream_stream(
                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in reflection(iter([b""]), timeout=5):
                        pass
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert info.value.details() == MISSING_TOKEN
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_trainer_reaches_the_route_cache_with_its_own_settings():
    from trainer.config import load_config

    config = load_config(
        None,
        [
            "router_replay.mode=R3",
            "route_cache.target=cache:50051",
            "route_cache.ca_file=/certs/ca.pem",
            "route_cache.token_file=/run/secrets/token",
        ],
    )
    security = config.route_cache.security()
    assert security == ClientSecurity(ca_file="/certs/ca.pem", token_file="/run/secrets/token")
    assert security.uses_tls
