"""Redis faults under a running route cache: a node SIGKILLed and restarted from its
append-only file, and a Redis Cluster master SIGKILLed with replicas present."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from routereplay.client import RetryPolicy, RouteCacheClient
from routereplay.errors import NotFound
from routereplay.synthetic import synthetic_record
from tests.conftest import RedisProcess
from tests.route_cache.conftest import SMALL
from tests.route_cache.test_process import CacheProcess

# Long enough to carry a write across a Redis restart or a cluster failover (a few seconds).
RETRY = RetryPolicy(attempts=30, initial_backoff_s=0.1, max_backoff_s=0.5)


class Writer(threading.Thread):
    """Writes ``records`` one after the other through ``client``; ``acked`` lists the ids the
    service acknowledged, in order, and ``failed`` those it did not."""

    def __init__(self, client: RouteCacheClient, records):
        super().__init__(daemon=True)
        self.client, self.records = client, records
        self.acked: list[str] = []
        self.failed: list[tuple[str, str]] = []

    def run(self) -> None:
        for record in self.records:
            try:
                self.client.write(record)
                self.acked.append(record.sample_id)
            except Exception as exc:  # noqa: BLE001 - counted, then asserted by the test
                self.failed.append((record.sample_id, repr(exc)))

    def wait_acked(self, count: int, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.acked) < count:
            assert time.monotonic() < deadline and self.is_alive(), self.failed
            time.sleep(0.01)


def assert_same(got, want) -> None:
    """Byte-identical: token ids, routes, turns and their log-probs, group."""
    assert (got.sample_id, got.group_id, got.geometry) == (
        want.sample_id,
        want.group_id,
        want.geometry,
    )
    assert got.token_ids.tobytes() == want.token_ids.tobytes()
    assert got.routes.dtype == want.routes.dtype
    assert got.routes.tobytes() == want.routes.tobytes()
    assert len(got.turns) == len(want.turns)
    for a, b in zip(got.turns, want.turns, strict=True):
        assert (a.token_start, a.token_end, a.generated_start, a.policy_version) == (
            b.token_start,
            b.token_end,
            b.generated_start,
            b.policy_version,
        )
        assert np.asarray(a.logprobs, "<f4").tobytes() == np.asarray(b.logprobs, "<f4").tobytes()


def records(prefix: str, count: int, seed: int, tokens: int = 300):
    rng = np.random.default_rng(seed)
    return [
        synthetic_record(f"{prefix}-{i}", SMALL, tokens, rng, group_id=f"{prefix}-g{i // 4}")
        for i in range(count)
    ]


# appendfsync always: Redis fsyncs the AOF before it replies, so an acknowledged write
# survives the process being killed and the machine losing power. everysec: the write reaches
# the kernel before the reply (it survives SIGKILL) but is fsynced up to a second later.
# "no" (no AOF) is the control: the same test must then see the acknowledged records vanish.
@pytest.mark.parametrize("appendfsync", ["always", "everysec", "no-aof"])
def test_redis_killed_and_restarted_from_its_append_only_file(appendfsync):
    aof = ["--appendonly", "no"] if appendfsync == "no-aof" else ["--appendonly", "yes"]
    node = RedisProcess(*aof, "--appendfsync", appendfsync.replace("no-aof", "always")).start()
    cache = CacheProcess(node.url).start()
    sent = records(f"aof-{appendfsync}", 40, seed=11)
    try:
        with RouteCacheClient(f"127.0.0.1:{cache.port}", retry=RETRY, timeout_s=10) as client:
            writer = Writer(client, sent)
            writer.start()
            writer.wait_acked(10)
            node.kill()  # SIGKILL, mid-stream of writes
            acked_before_kill = list(writer.acked)
            time.sleep(1.0)
            node.start()  # same port, same dir: it reloads its append-only file
            writer.join(60)
            assert not writer.is_alive() and writer.failed == []
            assert len(acked_before_kill) < len(sent)  # the kill did land among the writes
            if appendfsync == "no-aof":
                for sample_id in acked_before_kill:
                    with pytest.raises(NotFound):
                        client.stat(sample_id)
                return
            by_id = {r.sample_id: r for r in sent}
            got = list(client.read_batch(writer.acked))
        assert len(got) == len(sent)
        for record in got:
            assert_same(record, by_id[record.sample_id])
    finally:
        cache.stop()
        node.stop()
