"""The shared server plumbing over real sockets: the liveness health name and the maximum
connection age."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from routereplay.rpc.grpc_server import LIVENESS, ServerLimits, make_server, set_serving
from routereplay.rpc.security import ServerSecurity, add_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def serve(limits: ServerLimits):
    server, health = make_server(limits, ["test.Service"])
    port = add_port(server, "127.0.0.1:0", ServerSecurity())
    server.start()
    return server, health, f"127.0.0.1:{port}"


def test_liveness_serves_whatever_the_services_status():
    server, health, target = serve(ServerLimits())
    try:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(name):
                return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status

            for serving in (False, True, False):
                set_serving(health, ["test.Service"], serving)
                want = SERVING if serving else NOT_SERVING
                assert (status(""), status("test.Service"), status(LIVENESS)) == (
                    want,
                    want,
                    SERVING,
                )
    finally:
        server.stop(None)


def test_connections_are_sent_away_at_their_maximum_age():
    """A connection past its age gets GOAWAY: the channel drops to IDLE (and reconnects on the
    next call, which succeeds), so clients spread onto replicas added since they connected."""
    server, health, target = serve(
        ServerLimits(max_connection_age_s=0.5, max_connection_age_grace_s=0.5)
    )
    set_serving(health, ["test.Service"], True)
    states = []
    went_idle = threading.Event()

    def watch(state):
        states.append(state)
        if state == grpc.ChannelConnectivity.IDLE and grpc.ChannelConnectivity.READY in states:
            went_idle.set()

    try:
        with grpc.insecure_channel(target) as channel:
            channel.subscribe(watch, try_to_connect=False)
            stub = health_pb2_grpc.HealthStub(channel)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
            assert went_idle.wait(30), states
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
            channel.unsubscribe(watch)
    finally:
        server.stop(None)


@pytest.mark.parametrize("field", ["max_connection_age_s", "max_connection_age_grace_s"])
def test_negative_connection_ages_are_refused(field):
    with pytest.raises(ValueError, match=field):
        ServerLimits(**{field: -1})
