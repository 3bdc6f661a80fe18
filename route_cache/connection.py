"""Connecting to Redis or Redis Cluster, waiting for replicas (``WAIT``), and what its
failures mean to callers: the parts of the Redis client the record store and the ready feed
share."""

from __future__ import annotations

import redis
import redis.cluster
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from routereplay.errors import ResourceExhausted, Unavailable

# How long a write waits for its replicas (``WAIT``) before it is answered UNAVAILABLE.
WAIT_TIMEOUT_MS = 2_000

# What redis-py raises when the server cannot be reached or a cluster is failing over
# (MOVED and READONLY reach us only on a single node's connection, used for WAIT).
CONNECTION_ERRORS = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
    redis.exceptions.AskError,
    redis.exceptions.ReadOnlyError,
)


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` says Redis cannot be reached (not that a command is wrong). A cluster
    client with no reachable node raises the generic ``RedisClusterException``, which also
    reports mistakes; only one caused by a connection failure counts."""
    if isinstance(exc, CONNECTION_ERRORS):
        return True
    return isinstance(exc, redis.exceptions.RedisClusterException) and isinstance(
        exc.__cause__, CONNECTION_ERRORS
    )


# Records are megabytes: redis-py's default 64 KiB socket reads cost about a tenth of a batch
# read (GETs of 12 MiB values: 699 MiB/s at 64 KiB, 773 at 256 KiB, 813 at 1 MiB, one run).
SOCKET_READ_BYTES = 256 * 1024


# How a cluster client retries a command (after reading the slot map again) when a node cannot
# be reached. redis-py's default pauses up to 1 s between its 10 retries, so a write through
# a MULTI that began during a failover went on 1-2 s after the promotion (3.8 s in all,
# measured): pauses of at most 0.1 s find the new master within 0.1 s, and the 10 retries
# end within about 0.8 s, after which the writer's own retry policy takes over.
CLUSTER_RETRY_CAP_S = 0.1


def connect(url: str, cluster: bool, **kwargs) -> redis.Redis | redis.cluster.RedisCluster:
    """A redis-py client for a single server or a cluster; the rest of the code is the same."""
    kwargs.setdefault("socket_read_size", SOCKET_READ_BYTES)
    if cluster:
        kwargs.setdefault(
            "retry",
            Retry(ExponentialWithJitterBackoff(base=0.01, cap=CLUSTER_RETRY_CAP_S), retries=10),
        )
        return redis.cluster.RedisCluster.from_url(url, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def replicated(client, key: str, queue, replicas: int, timeout_ms: int) -> tuple[list, int]:
    """Run the commands ``queue(pipe)`` puts on a pipeline (all on ``key``'s slot), then
    ``WAIT replicas timeout_ms``, in one round trip on one connection to ``key``'s master
    (WAIT counts the replicas that hold that connection's own writes).

    In a cluster that connection is the master's own, which does not follow a failover as the
    cluster client's commands do: when it fails (the old master is down, or answers MOVED as
    a replica), the slot map is read again, and the command runs once more at once if the key
    has another master now (callers' commands are safe to run twice). Without that, appends
    went on to the old master until some other command happened to refresh the map.

    Returns:
        (the commands' results, how many replicas confirmed them).
    """
    if not isinstance(client, redis.cluster.RedisCluster):
        return _run_and_wait(client, queue, replicas, timeout_ms)
    node = client.get_node_from_key(key)
    try:
        return _run_and_wait(client.get_redis_connection(node), queue, replicas, timeout_ms)
    except redis.exceptions.MovedError as exc:  # the slot's master is the one it names
        client.nodes_manager.move_slot(exc)
        moved_to = client.get_node_from_key(key)
    except CONNECTION_ERRORS:
        client.nodes_manager.initialize()
        moved_to = client.get_node_from_key(key)
        if moved_to.name == node.name:
            raise
    return _run_and_wait(client.get_redis_connection(moved_to), queue, replicas, timeout_ms)


def _run_and_wait(node: redis.Redis, queue, replicas: int, timeout_ms: int) -> tuple[list, int]:
    """The commands, then WAIT (none when ``replicas`` is 0: nothing to confirm)."""
    with node.pipeline(transaction=False) as pipe:
        queue(pipe)
        if not replicas:
            return pipe.execute(), 0
        pipe.execute_command("WAIT", replicas, timeout_ms)
        *results, confirmed = pipe.execute()
    return results, int(confirmed)


class domain_errors_from_redis:
    """Turns redis-py's connection failures into Unavailable (gRPC UNAVAILABLE), and Redis
    refusing a write at its memory limit into ResourceExhausted."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and is_connection_error(exc):
            raise Unavailable(f"redis is unreachable: {exc}") from exc
        if exc_type is not None and issubclass(exc_type, redis.exceptions.OutOfMemoryError):
            raise ResourceExhausted(
                f"redis refused the write at its memory limit (maxmemory): {exc}; nothing was "
                "stored, retry later (records are freed as the trainer commits them)",
                retry_after_s=1.0,
            ) from exc
        return False
