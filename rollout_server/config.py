"""The rollout server's configuration: flags, each also readable from an environment variable
(``ROLLOUT_SERVER_<FLAG>``) so compose files and manifests can set it. Built once in ``main``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from routereplay.rpc.grpc_server import MIB, ServerLimits
from routereplay.rpc.metrics import MetricsConfig
from routereplay.rpc.security import ClientSecurity, ServerSecurity
from routereplay.rpc.service_config import parse_service_config

ENV_PREFIX = "ROLLOUT_SERVER_"


@dataclass(frozen=True)
class Config:
    """Attributes:
    host, port: where to listen (port 0 picks a free one).
    model: local Hugging Face MoE checkpoint folder; empty builds and serves the embedded
        tiny Qwen3-MoE (``routereplay.dev.tiny_model``) in ``tiny_model_dir``.
    model_id: identifier stored in every record's geometry; empty: the model folder's name.
    tiny_model_dir: where the embedded model is built; empty: a folder in the temp dir.
    route_cache: ``host:port`` of the route cache.
    dtype: weight dtype; empty: float32 on the CPU, the checkpoint's on a GPU.
    max_model_len: context length; 0: the model's.
    max_num_seqs, max_num_batched_tokens: the engine's batch limits (0: vLLM's default).
    enable_chunked_prefill, enable_prefix_caching: vLLM's switches.
    engine_seed: the engine's global sampling seed.
    capture_routes: return routed experts and store records; off only to measure the cost.
    policy_version: the version of the weights the server starts with.
    max_n: most samples per prompt in GenerateBatch; max_prompts: most prompts per batch.
    max_pending_writes: record writes waiting or retrying before new generation calls are
        refused with UNAVAILABLE.
    write_workers: concurrent record writes to the route cache.
    store_wait_s: how long a sample's final message waits for the cache's acknowledgement.
    write_retry_s: how long a write is retried before it is given up.
    cache_timeout_s: deadline of one route cache call.
    grace_s: how long in-flight calls and pending writes may finish on shutdown.
    security: TLS and the bearer token of this server (``routereplay.rpc.security``).
    route_cache_security: TLS and the token for reaching the route cache (flags
        ``--route-cache-ca-file`` and so on; the token from ``ROLLOUT_SERVER_ROUTE_CACHE_TOKEN``
        or ``--route-cache-token-file``).
    """

    host: str = "0.0.0.0"
    port: int = 50052
    model: str = ""
    model_id: str = ""
    tiny_model_dir: str = ""
    route_cache: str = "127.0.0.1:50051"
    dtype: str = ""
    max_model_len: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    engine_seed: int = 0
    capture_routes: bool = True
    policy_version: int = 0
    max_n: int = 64
    max_prompts: int = 256
    max_pending_writes: int = 256
    write_workers: int = 4
    store_wait_s: float = 60.0
    write_retry_s: float = 600.0
    cache_timeout_s: float = 30.0
    grace_s: float = 30.0
    # A connection past its age gets 10 minutes more: a group's generation can run minutes.
    limits: ServerLimits = field(
        default_factory=lambda: ServerLimits(
            max_message_bytes=64 * MIB, max_connection_age_grace_s=600.0
        )
    )
    security: ServerSecurity = field(default_factory=ServerSecurity)
    route_cache_security: ClientSecurity = field(
        default_factory=ClientSecurity, metadata={"flag_prefix": "route_cache_"}
    )
    # The Prometheus endpoint: --metrics, --metrics-port (off by default; routereplay.rpc.metrics).
    metrics: MetricsConfig = field(default_factory=lambda: MetricsConfig(metrics_port=9465))

    @property
    def shutdown_budget_s(self) -> float:
        """The longest a graceful stop takes: in-flight calls finish (up to ``grace_s``), then
        the pending record writes (up to ``grace_s`` again). A deployment's termination grace
        must exceed it, or the writes still queued are killed."""
        return 2 * self.grace_s

    def engine_args(self) -> dict:
        """The vLLM engine arguments these settings ask for (zeros left to vLLM)."""
        args = {
            "max_num_seqs": self.max_num_seqs,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "enable_prefix_caching": self.enable_prefix_caching,
            "seed": self.engine_seed,
        }
        optional = {"max_model_len": self.max_model_len,
                    "max_num_batched_tokens": self.max_num_batched_tokens}  # fmt: skip
        return args | {k: v for k, v in optional.items() if v > 0}


_HELP = {
    "host": "address to listen on",
    "port": "port to listen on (0: any free port)",
    "model": "Hugging Face MoE checkpoint folder; empty: the embedded tiny model",
    "model_id": "model identifier stored in records; empty: the folder's name",
    "tiny_model_dir": "where to build the embedded tiny model; empty: a temp folder",
    "route_cache": "host:port of the route cache",
    "dtype": "weight dtype; empty: float32 on CPU, the checkpoint's on GPU",
    "max_model_len": "context length (0: the model's)",
    "max_num_seqs": "most sequences per engine step",
    "max_num_batched_tokens": "most tokens per engine step (0: vLLM's default)",
    "enable_chunked_prefill": "prefill long prompts in chunks",
    "enable_prefix_caching": "reuse KV of shared prompt prefixes",
    "engine_seed": "the engine's global sampling seed",
    "capture_routes": "capture routed experts and store records (off: only to measure)",
    "policy_version": "policy version of the weights served at start",
    "max_n": "most samples per prompt in GenerateBatch",
    "max_prompts": "most prompts per GenerateBatch",
    "max_pending_writes": "record writes buffered before new calls get UNAVAILABLE",
    "write_workers": "concurrent record writes to the route cache",
    "store_wait_s": "seconds a final message waits for the cache's acknowledgement",
    "write_retry_s": "seconds a record write is retried before it is given up",
    "cache_timeout_s": "deadline of one route cache call, in seconds",
    "grace_s": "seconds in-flight calls and pending writes may finish on shutdown",
    "workers": "unused by this asyncio server (kept for symmetry with the route cache)",
}


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Flags override environment variables, which override the defaults."""
    return parse_service_config(
        Config,
        _HELP,
        prog="rollout-server",
        description="Router Replay's rollout server: vLLM generation with routed-expert capture.",
        env_prefix=ENV_PREFIX,
        argv=argv,
        env=env,
    )
