"""The memory budget of routes in flight: writes are refused before Redis is full.

Redis with ``maxmemory`` and ``noeviction`` refuses a write only once it is full, and then it
refuses every write, the ready feed's acknowledgements' bookkeeping included. The budget acts
earlier: a write or append whose record lands on a Redis node holding ``fraction`` of its
``maxmemory`` or more is answered RESOURCE_EXHAUSTED with ``retry_after_s``, before any of
its bytes are received, and nothing is stored. Memory comes back as the trainer commits what
it trained (``ReadyFeed``: records freed after every commit group's acknowledgement), so the
writers' retries land once it catches up.

Each node's ``used_memory`` and ``maxmemory`` are read from ``INFO memory`` by ``Upkeep``, a
background thread, every ``interval_s`` (no round trip on the write path): a write may pass on
a reading up to ``interval_s`` old, which is what ``1 - fraction`` of ``maxmemory`` must
absorb, beside the append-only file's rewrite buffer. A node whose ``maxmemory`` is 0 has no
budget. In a Redis Cluster every master is read, and a write is held to its own record's node.
"""

from __future__ import annotations

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

    def read(self) -> dict[str, NodeMemory]:
        """Read every master's memory now (a node that cannot be reached keeps its last
        reading: its writes fail on their own)."""
        nodes = dict(self.nodes)
        for name, node in self._masters():
            try:
                info = node.info("memory")
            except redis.exceptions.RedisError:
                continue
            nodes[name] = NodeMemory(name, int(info["used_memory"]), int(info["maxmemory"]))
        self.nodes = nodes
        return nodes

    def check(self, key: str) -> None:
        """Raise ResourceExhausted when ``key``'s node is at its budget."""
        if not self.fraction:
            return
        memory = self.nodes.get(self._node_of(key))
        if memory is None or not memory.maxmemory:
            return
        budget = int(self.fraction * memory.maxmemory)
        if memory.used >= budget:
            raise ResourceExhausted(
                f"the route cache is at its memory budget: Redis node {memory.node} holds "
                f"{memory.used / MIB:.0f} MiB, the budget is {budget / MIB:.0f} MiB "
                f"({self.fraction:g} of maxmemory {memory.maxmemory / MIB:.0f} MiB). Records "
                "are freed as the trainer commits them: nothing was stored, retry later",
                retry_after_s=max(4 * self.interval_s, 1.0),
            )

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
