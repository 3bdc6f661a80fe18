"""The memory budget of routes in flight: writes are refused before Redis is full.

Redis with ``maxmemory`` and ``noeviction`` refuses a write only once it is full, and then it
refuses every write, the ready feed's acknowledgements' bookkeeping included. The budget acts
earlier: a write or append whose bytes would take a Redis node past ``fraction`` of its
``maxmemory`` is answered RESOURCE_EXHAUSTED with ``retry_after_s``, before any of its bytes
are received, and nothing is stored. Memory comes back as the trainer commits what
it trained (``ReadyFeed``: records freed after every commit group's acknowledgement), so the
writers' retries land once it catches up.

Each node's ``used_memory`` and ``maxmemory`` are read from ``INFO memory`` by ``Upkeep``, a
background thread, every ``interval_s`` (no round trip on the write path); between two
readings, each write's bytes are added to its node's figure as it is admitted (``reserve``).
What ``1 - fraction`` of ``maxmemory`` must absorb: Redis's own overhead per record, the
writes of other route cache replicas since the last reading, and the ready feed's
bookkeeping, which the acknowledgements that free memory need (their script may run at the
memory limit: ``route_cache.feed``). A node whose ``maxmemory`` is 0 has no
budget. In a Redis Cluster every master is read, and a write is held to its own record's node.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.cluster

from routereplay.errors import ResourceExhausted

log = logging.getLogger(__name__)

MIB = 2**20


@dataclass(frozen=True)
class NodeMemory:
    """One Redis node's memory as ``INFO memory`` last reported it, in bytes."""

    node: str
    used: int
    maxmemory: int


class MemoryBudget:
    """Refuses writes to nodes at ``fraction`` of their ``maxmemory``.

    Args:
        client: the store's ``redis.Redis`` or ``redis.cluster.RedisCluster``.
        fraction: of each node's ``maxmemory`` that routes may fill (0: no budget).
        interval_s: seconds between two readings of every node (``read``, by ``Upkeep``).
    """

    def __init__(self, client, fraction: float, interval_s: float = 0.25):
        if not 0 <= fraction <= 1:
            raise ValueError(f"the memory budget is a fraction of maxmemory, got {fraction}")
        self.client = client
        self.fraction = fraction
        self.interval_s = interval_s
        self.nodes: dict[str, NodeMemory] = {}
        self._lock = threading.Lock()
        self.refused = 0  # writes refused at the budget
        self._since: dict[str, int] = {}  # bytes committed here since the node's last reading
        self._in_flight: dict[str, int] = {}  # bytes of writes reserved here, not yet done

    def read(self) -> dict[str, NodeMemory]:
        """Read every master's memory now (a node that cannot be reached keeps its last
        reading: its writes fail on their own)."""
        nodes = dict(self.nodes)
        for name, node in self._masters():
            with self._lock:
                before = self._since.get(name, 0)
            try:
                info = node.info("memory")
            except redis.exceptions.RedisError:
                continue
            with self._lock:  # the reading holds what was committed before it was asked for;
                # what was committed while it was asked stays counted (twice, at worst)
                self._since[name] = self._since.get(name, 0) - before
            nodes[name] = NodeMemory(name, int(info["used_memory"]), int(info["maxmemory"]))
        self.nodes = nodes
        return nodes

    @contextlib.contextmanager
    def reserve(self, key: str, size: int):
        """Hold ``size`` bytes of ``key``'s node's budget for one write, or raise
        ResourceExhausted (nothing received yet). Counted against the budget: the last
        reading, what this process committed since it, and the writes in flight here, so
        that a burst of writes between two readings cannot pass the budget together."""
        node = self._node_of(key)
        memory = self.nodes.get(node)
        if not self.fraction or memory is None or not memory.maxmemory:
            yield
            return
        budget = int(self.fraction * memory.maxmemory)
        with self._lock:
            held = memory.used + self._since.get(node, 0) + self._in_flight.get(node, 0)
            if held + size > budget:
                self.refused += 1
                raise ResourceExhausted(
                    f"the route cache is at its memory budget: Redis node {memory.node} holds "
                    f"{held / MIB:.0f} MiB with the writes in flight, the budget is "
                    f"{budget / MIB:.0f} MiB ({self.fraction:g} of maxmemory "
                    f"{memory.maxmemory / MIB:.0f} MiB). Records are freed as the trainer "
                    "commits them: nothing was stored, retry later",
                    retry_after_s=max(4 * self.interval_s, 1.0),
                )
            self._in_flight[node] = self._in_flight.get(node, 0) + size
        committed = False
        try:
            yield
            committed = True
        finally:
            with self._lock:
                self._in_flight[node] -= size
                if committed:
                    self._since[node] = self._since.get(node, 0) + size

    def used_fraction(self) -> dict[str, float]:
        """Each node's used memory as a fraction of its budget (nodes with a budget)."""
        return {
            m.node: m.used / (self.fraction * m.maxmemory)
            for m in self.nodes.values()
            if m.maxmemory and self.fraction
        }

    def _masters(self):
        if isinstance(self.client, redis.cluster.RedisCluster):
            return [
                (n.name, self.client.get_redis_connection(n)) for n in self.client.get_primaries()
            ]
        return [("redis", self.client)]

    def _node_of(self, key: str) -> str:
        if isinstance(self.client, redis.cluster.RedisCluster):
            return self.client.get_node_from_key(key).name
        return "redis"


class Upkeep:
    """A daemon thread that runs each ``(interval_s, task)`` of ``tasks`` that often, for as
    long as the route cache runs: the budget's readings, the ready stream's trim. A task that
    fails is logged and tried again next time (Redis may be away for a while)."""

    def __init__(self, tasks: list[tuple[float, Callable[[], object]]]):
        self.tasks = tasks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="route-cache-upkeep", daemon=True)

    def start(self) -> Upkeep:
        if self.tasks:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        due = [0.0] * len(self.tasks)
        tick = min(interval for interval, _ in self.tasks)
        while True:
            now = time.monotonic()
            for i, (interval, task) in enumerate(self.tasks):
                if now >= due[i]:
                    due[i] = now + interval
                    try:
                        task()
                    except Exception:  # noqa: BLE001 - upkeep must outlive Redis's absences
                        log.warning("route cache upkeep: %s failed", task, exc_info=True)
            if self._stop.wait(tick):
                return
