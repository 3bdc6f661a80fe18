"""The route cache's configuration: flags, each also readable from an environment variable
(``ROUTE_CACHE_<FLAG>``) so compose files and manifests can set it. Built once in ``main``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from routereplay.rpc.grpc_server import MIB, ServerLimits
from routereplay.rpc.metrics import MetricsConfig
from routereplay.rpc.security import ENV_ONLY, ServerSecurity, read_secret
from routereplay.rpc.service_config import flag, parse_service_config

ENV_PREFIX = "ROUTE_CACHE_"
# Below the 30 s socket timeout the service gives its Redis client: a waiting read must not
# look like a dead connection.
MAX_BLOCK_MS = 20_000


@dataclass(frozen=True)
class RedisSecurity:
    """How the route cache signs in to Redis and encrypts the connection (flags
    ``--redis-*``). A user and password in ``redis_url`` work as well
    (``redis://user:password@host:6379/0``, the URL wins); ``password`` comes from the
    environment only (never a flag, never in repr)."""

    username: str = flag("", "Redis ACL user (empty: the default user)")
    password_file: str = flag(
        "", "file holding the Redis password (or set ROUTE_CACHE_REDIS_PASSWORD)"
    )
    password: str = field(default="", repr=False, metadata=ENV_ONLY)
    tls_ca_file: str = flag("", "PEM CA of Redis's certificate (rediss:// URLs)")
    tls_cert_file: str = flag("", "PEM client certificate for Redis (tls-auth-clients)")
    tls_key_file: str = flag("", "PEM client key for Redis")

    def __post_init__(self):
        if self.password and self.password_file:
            raise ValueError("set redis_password or redis_password_file, not both")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("redis_tls_cert_file and redis_tls_key_file go together")

    def connect_kwargs(self) -> dict:
        """redis-py's keyword arguments for these settings; the password file is read now."""
        password = self.password
        if self.password_file:
            password = read_secret(self.password_file, "redis_password_file").decode()
        kwargs = {"username": self.username or None, "password": password or None}
        if self.tls_ca_file:
            kwargs["ssl_ca_certs"] = self.tls_ca_file
        if self.tls_cert_file:
            kwargs |= {"ssl_certfile": self.tls_cert_file, "ssl_keyfile": self.tls_key_file}
        return {k: v for k, v in kwargs.items() if v is not None}


@dataclass(frozen=True)
class Config:
    """The route cache's settings; each field's flag help (``--help``) says what it sets.
    Nested: ``redis`` (``RedisSecurity``), ``security`` (this server's TLS and token,
    ``routereplay.rpc.security``), ``metrics`` (the Prometheus endpoint, port 9464, off by
    default)."""

    host: str = flag("0.0.0.0", "address to listen on")
    port: int = flag(50051, "port to listen on (0: any free port)")
    redis_url: str = flag(
        "", "redis[s]://[user:pass@]host:port/db (rediss: TLS); empty: an embedded server"
    )
    redis_cluster: bool = flag(False, "redis_url is a node of a Redis Cluster")
    wait_replicas: int = flag(
        0, "replicas that must confirm a write before it is acknowledged (0: none)"
    )
    ttl_s: float = flag(86400.0, "seconds a record lives after its last write (0: forever)")
    max_record_mib: int = flag(512, "largest route block accepted per write or append, in MiB")
    max_batch: int = flag(1024, "most sample ids per ReadBatch")
    max_write_chunks: int = flag(4096, "most chunk messages per WriteRecord or AppendTurn stream")
    grace_s: float = flag(30.0, "seconds in-flight calls may finish on shutdown")
    ready_stream: str = flag("rr:ready", "Redis Stream key of the ready feed (empty: no feed)")
    ready_maxlen: int = flag(
        100_000,
        "most entries the ready stream holds; at the cap writes are refused "
        "(RESOURCE_EXHAUSTED), never old entries dropped (0: no cap)",
    )
    commit_groups: str = flag(
        "",
        "consumer groups (comma-separated) that must each acknowledge a sample before its "
        "record is freed (empty: records live out --ttl-s)",
    )
    free_grace_s: float = flag(60.0, "seconds a freed record stays readable")
    memory_budget: float = flag(
        0.9,
        "fraction of each Redis node's maxmemory routes may fill before writes are refused "
        "with RESOURCE_EXHAUSTED (0: no budget)",
    )
    ready_max_block_ms: int = flag(10_000, "longest wait for new entries a ReadReady may ask for")
    health_interval_s: float = flag(1.0, "seconds between Redis health probes")
    health_timeout_s: float = flag(
        1.0, "seconds Redis may take to answer a health probe before readiness turns NOT_SERVING"
    )
    limits: ServerLimits = field(default_factory=ServerLimits)
    redis: RedisSecurity = field(default_factory=RedisSecurity, metadata={"flag_prefix": "redis_"})
    security: ServerSecurity = field(default_factory=ServerSecurity)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self):
        if (self.redis.tls_ca_file or self.redis.tls_cert_file) and not self.redis_url.startswith(
            "rediss://"
        ):
            raise ValueError("redis_tls_* files need a rediss:// redis_url")
        if self.max_write_chunks < 1:
            raise ValueError(f"max_write_chunks must be >= 1, got {self.max_write_chunks}")
        if self.ready_maxlen < 0:
            raise ValueError(f"ready_maxlen must be >= 0, got {self.ready_maxlen}")
        if not 0 <= self.memory_budget <= 1:
            raise ValueError(f"memory_budget must be in [0, 1], got {self.memory_budget}")
        if self.free_grace_s < 0:
            raise ValueError(f"free_grace_s must be >= 0, got {self.free_grace_s}")
        if self.commit_groups and not self.ready_stream:
            raise ValueError("commit_groups needs the ready feed (--ready-stream)")
        if not 0 <= self.ready_max_block_ms <= MAX_BLOCK_MS:
            raise ValueError(
                f"ready_max_block_ms must be in [0, {MAX_BLOCK_MS}], got {self.ready_max_block_ms}"
            )

    @property
    def commit_group_names(self) -> tuple[str, ...]:
        return tuple(g.strip() for g in self.commit_groups.split(",") if g.strip())

    @property
    def shutdown_budget_s(self) -> float:
        """The longest a graceful stop takes: in-flight calls finish for up to ``grace_s``. A
        deployment's termination grace must exceed it (plus any preStop pause)."""
        return self.grace_s

    @property
    def max_record_bytes(self) -> int:
        return self.max_record_mib * MIB


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Flags override environment variables, which override the defaults."""
    return parse_service_config(
        Config,
        prog="route-cache",
        description="Router Replay's route cache: records in Redis, served over gRPC.",
        env_prefix=ENV_PREFIX,
        argv=argv,
        env=env,
    )
