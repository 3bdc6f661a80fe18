"""Starting and stopping the services as local processes (the main job, benchmarks, tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from routereplay.rpc.security import PLAINTEXT, ClientSecurity, secure_channel


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago (all sockets are held
    open together, so the kernel cannot hand out one port twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


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
