"""The rollout server's configuration: flags, each also readable from an environment variable
(``ROLLOUT_SERVER_<FLAG>``) so compose files and manifests can set it. Built once in ``main``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from routereplay.rpc.grpc_server import MIB, ServerLimits
from routereplay.rpc.metrics import MetricsConfig
from routereplay.rpc.security import ClientSecurity, ServerSecurity
from routereplay.rpc.service_config import flag, parse_service_config

ENV_PREFIX = "ROLLOUT_SERVER_"
# What a stop takes after the pending writes: vLLM waits up to 5 s for its engine process before
# it kills it, then the process exits (measured: 6.9 s for the tiny model on the CPU).
ENGINE_SHUTDOWN_S = 10.0


@dataclass(frozen=True)
class Config:
    """The rollout server's settings; each field's flag help (``--help``) says what it sets.
    Nested: ``security`` (this server's TLS and token), ``route_cache_security`` (reaching the
    route cache: ``--route-cache-ca-file`` and so on, the token from
    ``ROLLOUT_SERVER_ROUTE_CACHE_TOKEN`` or ``--route-cache-token-file``), ``metrics`` (the
    Prometheus endpoint, port 9465, off by default)."""

    host: str = flag("0.0.0.0", "address to listen on")
    port: int = flag(50052, "port to listen on (0: any free port)")
    model: str = flag("", "Hugging Face MoE checkpoint folder; empty: the embedded tiny model")
    model_id: str = flag("", "model identifier stored in records; empty: the folder's name")
    tiny_model_dir: str = flag("", "where to build the embedded tiny model; empty: a temp folder")
    route_cache: str = flag("127.0.0.1:50051", "host:port of the route cache")
    dtype: str = flag("", "weight dtype; empty: float32 on CPU, the checkpoint's on GPU")
    max_model_len: int = flag(0, "context length (0: the model's)")
    max_num_seqs: int = flag(64, "most sequences per engine step")
    max_num_batched_tokens: int = flag(0, "most tokens per engine step (0: vLLM's default)")
    enable_chunked_prefill: bool = flag(True, "prefill long prompts in chunks")
    enable_prefix_caching: bool = flag(True, "reuse KV of shared prompt prefixes")
    engine_seed: int = flag(0, "the engine's global sampling seed")
    capture_routes: bool = flag(
        True, "capture routed experts and store records (off: only to measure)"
    )
    policy_version: int = flag(0, "policy version of the weights served at start")
    max_n: int = flag(64, "most samples per prompt in GenerateBatch")
    max_prompts: int = flag(256, "most prompts per GenerateBatch")
    max_pending_writes: int = flag(256, "record writes buffered before new calls get UNAVAILABLE")
    write_workers: int = flag(4, "concurrent record writes to the route cache")
    store_wait_s: float = flag(
        60.0, "seconds a final message waits for the cache's acknowledgement"
    )
    write_retry_s: float = flag(600.0, "seconds a record write is retried before it is given up")
    cache_timeout_s: float = flag(30.0, "deadline of one route cache call, in seconds")
    grace_s: float = flag(30.0, "seconds in-flight calls and pending writes may finish on shutdown")
    # A connection past its age gets 10 minutes more: a group's generation can run minutes.
    # No --workers: handlers are coroutines here, not threads.
    limits: ServerLimits = field(
        default_factory=lambda: ServerLimits(
            max_message_bytes=64 * MIB, max_connection_age_grace_s=600.0
        ),
        metadata={"no_flags": ("workers",)},
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
        the pending record writes (up to ``grace_s`` again), then the engine shuts down
        (``ENGINE_SHUTDOWN_S``). A deployment's termination grace must exceed it, or the
        writes still queued are killed."""
        return 2 * self.grace_s + ENGINE_SHUTDOWN_S

    def engine_args(self) -> dict:
        """The vLLM engine arguments these settings ask for (zeros left to vLLM)."""
        args = {
            "max_num_seqs": self.max_num_seqs,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "enable_prefix_caching": self.enable_prefix_caching,
            "seed": self.engine_seed,
        }
        optional = {
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        return args | {k: v for k, v in optional.items() if v > 0}


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Flags override environment variables, which override the defaults."""
    return parse_service_config(
        Config,
        prog="rollout-server",
        description="Router Replay's rollout server: vLLM generation with routed-expert capture.",
        env_prefix=ENV_PREFIX,
        argv=argv,
        env=env,
    )
