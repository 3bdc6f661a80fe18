"""Redis faults under a running route cache: a node SIGKILLed and restarted from its
append-only file, and a Redis Cluster master SIGKILLed with replicas present."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import redis

from route_cache.config import Config
from route_cache.server import RouteCacheServer
from route_cache.store import STAGING_TTL_MS, RouteStore, connect, record_key
from routereplay.dev.redis_nodes import RedisProcess, start_cluster_with_replicas
from routereplay.dev.synthetic import synthetic_record
from routereplay.domain.record import Missing
from routereplay.errors import NotFound, ResourceExhausted, Unavailable
from routereplay.rpc.client import RetryPolicy, RouteCacheClient
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


def wait_promoted(replica: RedisProcess, timeout_s: float = 30) -> float:
    """Seconds until ``replica`` is a master of a cluster in state ok."""
    client, start = redis.Redis(port=replica.port), time.monotonic()
    while (
        client.info("replication")["role"] != "master"
        or client.cluster("INFO")["cluster_state"] != "ok"
    ):
        assert time.monotonic() - start < timeout_s, "no failover"
        time.sleep(0.05)
    return time.monotonic() - start


def cut_off_replica(master: RedisProcess, replica: RedisProcess) -> None:
    """Cut ``replica`` off its master, like a network partition between the two: the master
    now asks for a password the replica does not have and closes its replication link, so the
    replica cannot resync. Connections already open (the route cache's) stay signed in, and
    the cluster bus is untouched, so the failover still happens."""
    client = redis.Redis(port=master.port)
    client.config_set("requirepass", "cut-off")
    client.client_kill_filter(_type="replica")
    link = redis.Redis(port=replica.port)
    deadline = time.monotonic() + 10
    while link.info("replication")["master_link_status"] != "down":
        assert time.monotonic() < deadline, "the replica is still linked"
        time.sleep(0.01)


def failover_under_writes(wait_replicas: int, cut_off: bool, record_property):
    """Write 400 records through a route cache over a 3-master, 3-replica cluster and SIGKILL
    one master mid-way (after cutting its replica off, with ``cut_off``); restart it once its
    replica has taken over, so that it rejoins as that replica's replica.

    Returns:
        (ids acknowledged but not stored, ids of the failed shard acknowledged while its
        replica was cut off). Every record that is stored reads back byte-identical.
    """
    masters, replicas = start_cluster_with_replicas(3, 1, node_timeout_ms=1000)
    victim, heir = masters[0], replicas[0]
    client = connect(masters[1].url.rsplit("/", 1)[0], cluster=True, socket_connect_timeout=1)
    store = RouteStore(client, batch_window=16, wait_replicas=wait_replicas)
    server = RouteCacheServer(
        Config(host="127.0.0.1", port=0, grace_s=1, health_interval_s=0.1), store
    ).start()
    sent = records(f"failover-w{wait_replicas}-{cut_off}", 400, seed=12, tokens=64)
    victim_slots = {int(s) for a, b in victim_slot_ranges(victim) for s in range(a, b + 1)}
    on_victim = {
        r.sample_id for r in sent if client.keyslot(record_key(r.sample_id)) in victim_slots
    }
    try:
        with RouteCacheClient(f"127.0.0.1:{server.port}", retry=RETRY, timeout_s=10) as cache:
            writer = Writer(cache, sent)
            writer.start()
            writer.wait_acked(60)
            if cut_off:
                cut_off_replica(victim, heir)
            mark = len(writer.acked)
            if cut_off:
                time.sleep(0.3)  # the writes go on meanwhile
            victim.kill()
            acked_at_kill = len(writer.acked)
            failover_s = wait_promoted(heir)
            # Restarted (empty, keeping its cluster config), the old master rejoins as a
            # replica of its heir: until then WAIT 1 cannot succeed on that shard.
            victim.start()
            writer.join(60)
            assert not writer.is_alive() and writer.failed == []
            assert set(writer.acked[acked_at_kill:]) & on_victim  # the failed shard took writes
            got = list(cache.read_batch(writer.acked, skip_missing=True))
        by_id = {r.sample_id: r for r in sent}
        lost = {g.sample_id for g in got if isinstance(g, Missing)}
        for record in got:
            if not isinstance(record, Missing):
                assert_same(record, by_id[record.sample_id])
        assert lost <= on_victim  # only the killed master's shard can lose anything
        record_property("failover_s", round(failover_s, 2))
        record_property("lost_acknowledged", len(lost))
        print(f"WAIT {wait_replicas}: failover {failover_s:.2f} s, lost {len(lost)} acknowledged")
        return lost, set(writer.acked[mark:acked_at_kill]) & on_victim if cut_off else set()
    finally:
        server.stop(0)
        client.close()
        for node in masters + replicas:
            node.kill()


# With one replica per master, the replica WAIT counted is the one the failover promotes, so
# WAIT 1 must lose nothing acknowledged; the shard's writes then wait for a new replica.
# Without WAIT, replication is asynchronous: a write acknowledged just before the kill may never
# reach the replica. That count is reported, not asserted (on loopback the replica is usually
# less than a write behind).
@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_cluster_master_killed_fails_over_and_writes_resume(wait_replicas, record_property):
    lost, _ = failover_under_writes(wait_replicas, cut_off=False, record_property=record_property)
    if wait_replicas:
        assert lost == set()


# The replica is cut off before its master dies: without WAIT, the writes the failed shard
# acknowledged meanwhile are lost; with WAIT 1 they were not acknowledged, and their retries
# land on the promoted replica.
@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_cluster_master_killed_after_its_replica_was_cut_off(wait_replicas, record_property):
    lost, acked_cut_off = failover_under_writes(
        wait_replicas, cut_off=True, record_property=record_property
    )
    print(f"acknowledged by the failed shard while its replica was cut off: {len(acked_cut_off)}")
    if wait_replicas:
        assert lost == set()
    else:
        # The writer has one write in flight at a time: at most one of these was committed
        # (and replicated) before the cut.
        assert acked_cut_off and len(acked_cut_off & lost) >= len(acked_cut_off) - 1


def victim_slot_ranges(node: RedisProcess) -> list[tuple[int, int]]:
    """The slot ranges ``node`` serves as a master."""
    myid = redis.Redis(port=node.port).execute_command("CLUSTER MYID").decode()
    shards = redis.Redis(port=node.port).execute_command("CLUSTER SLOTS")
    return [(a, b) for a, b, master, *_ in shards if master[2].decode() == myid]


def test_wait_refuses_to_acknowledge_a_write_no_replica_confirms(redis_node):
    """A single node has no replica: with WAIT 1 the write is stored but not acknowledged."""
    store = RouteStore(connect(redis_node.url, cluster=False), wait_replicas=1, wait_timeout_ms=50)
    server = RouteCacheServer(Config(host="127.0.0.1", port=0, grace_s=1), store).start()
    record = records("unconfirmed", 1, seed=13)[0]
    try:
        once = RetryPolicy(attempts=1)
        with RouteCacheClient(f"127.0.0.1:{server.port}", retry=once) as cache:
            with pytest.raises(Unavailable, match="0 of 1 replicas confirmed"):
                cache.write(record)
            store.wait_replicas = 0
            assert cache.write(record).duplicate  # the retry finds it stored whole
            assert_same(cache.read(record.sample_id), record)
    finally:
        server.stop(0)
        store.client.close()


def test_a_payload_redis_refuses_leaves_only_an_expiring_staging_hash():
    """Redis at its memory limit refuses the record's routes (sent after the staging hash is
    created with its expiry): RESOURCE_EXHAUSTED, no record, the staging hash expires; once
    Redis has room the retry stores the record whole."""
    node = RedisProcess("--maxmemory", "4mb", "--maxmemory-policy", "noeviction").start()
    client = connect(node.url, cluster=False)
    store = RouteStore(client)
    server = RouteCacheServer(Config(host="127.0.0.1", port=0, grace_s=1), store).start()
    record = synthetic_record("oom", SMALL, 400_000, np.random.default_rng(5))  # 8 MB routes
    try:
        with RouteCacheClient(f"127.0.0.1:{server.port}") as cache:
            with pytest.raises(ResourceExhausted, match="memory limit"):
                cache.write(record)
            assert client.exists(record_key(record.sample_id)) == 0
            staged = list(client.scan_iter(match=f"{record_key(record.sample_id)}:stage:*"))
            assert len(staged) <= 1
            assert all(0 < client.pttl(key) <= STAGING_TTL_MS for key in staged)
            client.config_set("maxmemory", 0)
            assert cache.write(record).duplicate is False
            assert_same(cache.read(record.sample_id), record)
    finally:
        server.stop(0)
        client.close()
        node.stop()
