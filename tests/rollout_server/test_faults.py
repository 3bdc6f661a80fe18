"""The rollout server as a real process (``python -m rollout_server``), SIGKILLed while it
generates: the client gets UNAVAILABLE instead of hanging, and no record or part of one reaches
the route cache.

It starts its own vLLM engine in that process; it uses none of the session engine's fixtures,
so run alone it holds one engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
import redis

from routereplay.domain.rollout import SampleDelta, SamplingOptions
from routereplay.errors import NotFound, Unavailable
from routereplay.rpc.rollout_client import AsyncRolloutClient
from tests.rollout_server.conftest import start_rollout_process
from tests.route_cache.conftest import raw_keys

pytest.importorskip("vllm")


@pytest.fixture
def rollout_process(tiny_model_dir, route_cache):
    """``python -m rollout_server`` on the tiny model, in its own process group so that the
    teardown can reap whatever the kill leaves behind."""
    proc, target = start_rollout_process(
        tiny_model_dir, route_cache.target, "--max-model-len", "512", "--max-num-seqs", "4"
    )
    try:
        yield proc, target
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_killed_mid_generation(rollout_process, cache_reader, redis_node, record_property, loop):
    proc, target = rollout_process
    workers = psutil.Process(proc.pid).children(recursive=True)
    sample_id = f"killed-{os.getpid()}"

    async def generate_and_kill():
        deltas = 0
        async with AsyncRolloutClient(target, timeout_s=120) as client:
            options = SamplingOptions(temperature=1.0, max_tokens=400)
            with pytest.raises(Unavailable) as error:
                async for event in client.generate("Tell me a long story.", options, sample_id):
                    assert isinstance(event, SampleDelta)  # killed before it could finish
                    deltas += 1
                    if deltas == 3:
                        proc.send_signal(signal.SIGKILL)
                        killed_at = time.monotonic()
        return deltas, time.monotonic() - killed_at, error.value

    # The session's loop, not asyncio.run: that would leave the thread without a current loop.
    deltas, waited_s, error = loop.run_until_complete(asyncio.wait_for(generate_and_kill(), 60))
    record_property("unavailable_after_kill_s", round(waited_s, 3))
    print(f"UNAVAILABLE {waited_s:.3f} s after the kill: {error}")
    assert deltas >= 3 and proc.wait(10) == -signal.SIGKILL
    with pytest.raises(NotFound):
        cache_reader.stat(sample_id)
    assert raw_keys(redis.Redis.from_url(redis_node.url), f"*{sample_id}*") == []
    # Not asserted, reported: vLLM's engine core and its worker do not notice that the server
    # died (measured: still running 100 s later, holding about 2.4 GB), so whoever starts the
    # server must stop its process group (the fixture does). See docs/reliability.md.
    _, alive = psutil.wait_procs(workers, timeout=5)
    record_property("engine_processes_left", len(alive))
    print(f"engine processes still running 5 s after the kill: {[p.name() for p in alive]}")
