"""The route cache's configuration: flags, each also readable from an environment variable
(``ROUTE_CACHE_<FLAG>``) so compose files and manifests can set it. Built once in ``main``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from routereplay.grpc_server import MIB, ServerLimits
from routereplay.service_config import parse_service_config

ENV_PREFIX = "ROUTE_CACHE_"
# Below the 30 s socket timeout the service gives its Redis client: a waiting read must not
# look like a dead connection.
MAX_BLOCK_MS = 20_000


@dataclass(frozen=True)
class Config:
    """Attributes:
    host, port: where to listen (port 0 picks a free one).
    redis_url: the Redis server or a cluster node; empty starts an embedded server.
    redis_cluster: treat redis_url as a node of a Redis Cluster.
    wait_replicas: acknowledge a write only once this many replicas hold it (Redis WAIT).
    ttl_s: records expire this long after their last write; 0 keeps them.
    max_record_mib: the largest route block accepted in one write or append.
    max_batch: the most sample ids one ReadBatch may ask for.
    grace_s: how long in-flight calls may finish on shutdown.
    ready_stream: the Redis Stream key of the ready feed; empty disables the feed.
    ready_maxlen: the stream keeps about this many entries (0: all).
    ready_max_block_ms: the longest a ReadReady may wait for new entries (each waiting call
        holds a handler thread; keep it below the Redis client's socket timeout).
    """

    host: str = "0.0.0.0"
    port: int = 50051
    redis_url: str = ""
    redis_cluster: bool = False
    wait_replicas: int = 0
    ttl_s: float = 86400.0
    max_record_mib: int = 512
    max_batch: int = 1024
    grace_s: float = 30.0
    ready_stream: str = "rr:ready"
    ready_maxlen: int = 100_000
    ready_max_block_ms: int = 10_000
    health_interval_s: float = 1.0
    limits: ServerLimits = field(default_factory=ServerLimits)

    def __post_init__(self):
        if self.ready_maxlen < 0:
            raise ValueError(f"ready_maxlen must be >= 0, got {self.ready_maxlen}")
        if not 0 <= self.ready_max_block_ms <= MAX_BLOCK_MS:
            raise ValueError(
                f"ready_max_block_ms must be in [0, {MAX_BLOCK_MS}], got {self.ready_max_block_ms}"
            )

    @property
    def max_record_bytes(self) -> int:
        return self.max_record_mib * MIB


_HELP = {
    "host": "address to listen on",
    "port": "port to listen on (0: any free port)",
    "redis_url": "redis://[user:pass@]host:port/db; empty starts an embedded server",
    "redis_cluster": "redis_url is a node of a Redis Cluster",
    "wait_replicas": "replicas that must confirm a write before it is acknowledged (0: none)",
    "ttl_s": "seconds a record lives after its last write (0: forever)",
    "max_record_mib": "largest route block accepted per write or append, in MiB",
    "max_batch": "most sample ids per ReadBatch",
    "grace_s": "seconds in-flight calls may finish on shutdown",
    "ready_stream": "Redis Stream key of the ready feed (empty: no feed)",
    "ready_maxlen": "entries the ready stream keeps, about (0: all)",
    "ready_max_block_ms": "longest wait for new entries a ReadReady may ask for",
    "health_interval_s": "seconds between Redis health probes",
}


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Flags override environment variables, which override the defaults."""
    return parse_service_config(
        Config,
        _HELP,
        prog="route-cache",
        description="Router Replay's route cache: records in Redis, served over gRPC.",
        env_prefix=ENV_PREFIX,
        argv=argv,
        env=env,
    )
