"""Starting and stopping the services as local processes (the main job, benchmarks, tests)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from routereplay.rpc.security import PLAINTEXT, ClientSecurity, secure_channel

_LOWEST_PORT = 20_000  # well above the registered services' usual ports


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago (all sockets are held
    open together, so no port is handed out twice), below the kernel's ephemeral range.

    Not from the ephemeral range (what binding port 0 gives): ``wait_serving`` connects while
    the service is still loading, and the kernel may give such a client that very port as its
    own source port; with nothing listening yet, the socket connects to itself (TCP
    self-connect) and holds the port, and the service's bind then fails with "address already
    in use" (seen once in CI, a rollout server loading vLLM for 20 s). A port below the range
    is never a source port.
    """
    low = _ephemeral_low()
    ports: list[int] = []
    sockets = []
    try:
        while len(ports) < count:
            s = socket.socket()
            sockets.append(s)
            port = random.randrange(_LOWEST_PORT, low) if low > _LOWEST_PORT + 1000 else 0
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: draw again
                continue
            ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in sockets:
            s.close()


def _ephemeral_low() -> int:
    """The lowest port the kernel gives as a source port (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def wait_serving(
    target: str,
    proc: subprocess.Popen,
    timeout_s: float = 60.0,
    security: ClientSecurity = PLAINTEXT,
) -> None:
    """Block until the gRPC health service at ``target`` answers SERVING (over TLS when
    ``security`` asks for it; health checks need no token).

    Raises:
        RuntimeError: ``proc`` exited, or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    with secure_channel(target, security) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[:3]} exited with code {proc.returncode}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"{target} did not become healthy within {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> int:
    """SIGTERM, then SIGKILL after ``grace_s``; returns the exit code.

    A process that leads its own process group (``start_service`` starts services so) takes
    the rest of its group with it: vLLM's engine processes outlive a rollout server that died
    without shutting them down.
    """
    try:
        leads_group = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:  # already reaped
        leads_group = False
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    code = proc.wait()
    if leads_group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return code


def start_service(
    module: str,
    *args: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
    quiet: bool = False,
    timeout_s: float = 60.0,
    security: ClientSecurity = PLAINTEXT,
) -> tuple[subprocess.Popen, str]:
    """``python -m module ARGS --host 127.0.0.1 --port PORT``, returned once it is healthy
    (checked with ``security``, for a service started with TLS).

    Returns:
        (process, target ``host:port``). A process that never becomes healthy is stopped.
    """
    port = port or free_port()
    target = f"127.0.0.1:{port}"
    output = subprocess.DEVNULL if quiet else None
    # Its own process group, so that stopping it can reap whatever it leaves behind; the
    # caller stops it (a terminal's Ctrl-C reaches the caller, not the service).
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args, "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=output,
        stderr=output,
        process_group=0,
    )
    try:
        wait_serving(target, proc, timeout_s, security)
    except BaseException:
        stop_process(proc, 5)
        raise
    return proc, target
