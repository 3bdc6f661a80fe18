"""Shared fixtures: the tiny model, one event loop and ONE vLLM engine per session.

The engine fixture skips when vllm is not installed. vLLM's CPU backend runs
worker processes; the fixture shuts them down at session end (otherwise the
interpreter can abort at exit).
"""

from __future__ import annotations

import asyncio
import time

import pytest

try:  # 2 threads on 2 cores contend badly; vLLM's workers set their own.
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass

# Small enough that every prompt longer than this is prefilled in chunks.
MAX_NUM_BATCHED_TOKENS = 32
_timings: dict[str, float] = {}


@pytest.fixture(scope="session")
def max_num_batched_tokens():
    """The engine's token budget per step (prompts beyond it are chunked)."""
    return MAX_NUM_BATCHED_TOKENS


@pytest.fixture(scope="session")
def loop():
    """One event loop for the session: the engine is bound to its loop. It is also the
    thread's current loop, for the clients that tests build outside a running loop."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    asyncio.set_event_loop(None)
    loop.close()


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir, loop):
    pytest.importorskip("vllm")
    from rollout_server.engine import VLLMEngine

    async def start():
        return VLLMEngine(
            tiny_model_dir,
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            enable_chunked_prefill=True,
            enable_prefix_caching=True,
            seed=0,
        )

    t0 = time.perf_counter()
    engine = loop.run_until_complete(start())
    _timings["vLLM engine load (s)"] = time.perf_counter() - t0
    try:
        yield engine
    finally:
        engine.shutdown()


def pytest_terminal_summary(terminalreporter):
    for name, value in _timings.items():
        terminalreporter.write_line(f"{name}: {value:.1f}")


# ---------------------------------------------------------------- rollout server


class CacheProcess:
    """An in-process route cache over a real redis-server, restartable on the same port."""

    def __init__(self, redis_url: str):
        from route_cache.connection import connect
        from route_cache.store import RouteStore
        from routereplay.dev.launch import free_port

        self.port = free_port()
        self.store = RouteStore(connect(redis_url, cluster=False), ttl_ms=600_000)
        self.server = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> CacheProcess:
        from route_cache.config import Config
        from route_cache.server import RouteCacheServer

        config = Config(host="127.0.0.1", port=self.port, grace_s=1, health_interval_s=0.5)
        self.server = RouteCacheServer(config, self.store).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0)
            self.server = None


@pytest.fixture(scope="session")
def route_cache(redis_node):
    cache = CacheProcess(redis_node.url).start()
    yield cache
    cache.stop()


@pytest.fixture(scope="session")
def cache_reader(route_cache):
    """A blocking route cache client for reading records back."""
    from routereplay.rpc.client import RouteCacheClient

    with RouteCacheClient(route_cache.target, timeout_s=10) as client:
        yield client


def start_rollout_process(model_dir, route_cache_target: str, *args: str, env=None):
    """``python -m rollout_server ARGS`` on ``model_dir`` writing to the route cache, once it
    serves (vLLM's start takes minutes on a busy CPU), in its own process group so that the
    teardown can reap whatever a kill leaves behind. Returns (process, target)."""
    from routereplay.dev.launch import start_service

    return start_service(
        "rollout_server",
        "--route-cache",
        route_cache_target,
        "--model",
        str(model_dir),
        *args,
        env=env,
        timeout_s=300,
    )


def rollout_config(route_cache_target: str, **overrides):
    from rollout_server.config import Config

    settings = dict(
        host="127.0.0.1",
        port=0,
        route_cache=route_cache_target,
        grace_s=5,
        store_wait_s=30,
        write_retry_s=60,
        cache_timeout_s=5,
        max_n=8,
    )
    return Config(**{**settings, **overrides})


@pytest.fixture(scope="session")
def rollout(vllm_engine, route_cache, loop):
    """A rollout server on the session engine, and an asyncio client of it."""
    from rollout_server.server import RolloutServer
    from routereplay.rpc.rollout_client import AsyncRolloutClient

    async def start():
        server = await RolloutServer(rollout_config(route_cache.target), vllm_engine).start()
        return server, AsyncRolloutClient(f"127.0.0.1:{server.port}", timeout_s=120)

    server, client = loop.run_until_complete(start())
    yield server, client
    loop.run_until_complete(client.close())
    loop.run_until_complete(server.stop(1))


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    pytest.importorskip("transformers")
    from tests.rollout_server.oracle import load_hf_model

    return load_hf_model(tiny_model_dir)
