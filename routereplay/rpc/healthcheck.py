"""``python -m routereplay.rpc.healthcheck HOST:PORT [SERVICE]``: exit 0 when the gRPC health
service answers SERVING, 1 otherwise. For container health checks without extra binaries.

Against a TLS server, name the CA (and, for mutual TLS, this client's certificate and key) in
``HEALTHCHECK_CA_FILE``, ``HEALTHCHECK_CERT_FILE`` and ``HEALTHCHECK_KEY_FILE``. The health
service needs no token.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from routereplay.rpc.security import ClientSecurity, secure_channel


def security_from_env(env=os.environ) -> ClientSecurity:
    return ClientSecurity(
        ca_file=env.get("HEALTHCHECK_CA_FILE", ""),
        cert_file=env.get("HEALTHCHECK_CERT_FILE", ""),
        key_file=env.get("HEALTHCHECK_KEY_FILE", ""),
    )


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    service = argv[1] if len(argv) == 2 else ""
    with secure_channel(argv[0], security_from_env()) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3
            )
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}", file=sys.stderr)
            return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
