"""Redis faults under a running route cache: a node SIGKILLed and restarted from its
append-only file, and a Redis Cluster master SIGKILLed with replicas present."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
import redis

from route_cache.config import Config
from route_cache.connection import connect
from route_cache.record_format import record_key
from route_cache.server import RouteCacheServer
from route_cache.store import STAGING_TTL_MS, RouteStore
from routereplay.dev.redis_nodes import RedisProcess, start_cluster_with_replicas
from routereplay.dev.synthetic import synthetic_record
from routereplay.domain.record import Missing
from routereplay.errors import NotFound, ResourceExhausted, Unavailable
from routereplay.rpc.client import RetryPolicy, RouteCacheClient
from tests.route_cache.conftest import SMALL
from tests.route_cache.test_process import CacheProcess
from tests.route_cache.test_store import block

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


def wait_promoted(*candidates: RedisProcess, timeout_s: float = 30) -> RedisProcess:
    """The one of ``candidates`` (replicas of one master) that became a master of a cluster
    in state ok, once one has."""
    start = time.monotonic()
    while True:
        for node in candidates:
            client = redis.Redis(port=node.port)
            if (
                client.info("replication")["role"] == "master"
                and client.cluster("INFO")["cluster_state"] == "ok"
            ):
                return node
        assert time.monotonic() - start < timeout_s, "no failover"
        time.sleep(0.05)


def wait_linked(replica: RedisProcess, timeout_s: float = 30) -> None:
    """Until ``replica``'s link to its (new) master is up."""
    client, deadline = redis.Redis(port=replica.port), time.monotonic() + timeout_s
    while client.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica did not link"
        time.sleep(0.05)


def wait_known(nodes: list[RedisProcess], master: RedisProcess, timeout_s: float = 30) -> None:
    """Until every one of ``nodes`` names ``master`` as the master of slots (gossip has
    spread its promotion): a client reading the slot map from any of them finds it."""
    deadline = time.monotonic() + timeout_s
    while not all(
        any(
            m[1] == master.port
            for _, _, m, *_ in redis.Redis(port=n.port).execute_command("CLUSTER SLOTS")
        )
        for n in nodes
    ):
        assert time.monotonic() < deadline, "the promotion did not spread"
        time.sleep(0.05)


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
            killed_at = time.monotonic()
            wait_promoted(heir)
            failover_s = time.monotonic() - killed_at
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
            store.wait_replicas = server.feed.wait_replicas = 0
            assert cache.write(record).duplicate  # the retry finds it stored whole
            assert_same(cache.read(record.sample_id), record)
    finally:
        server.stop(0)
        store.client.close()


def test_a_payload_redis_refuses_leaves_only_an_expiring_staging_hash():
    """Redis at its memory limit refuses the record's routes (sent after the staging hash is
    created with its expiry): RESOURCE_EXHAUSTED, no record, the staging hash expires; once
    Redis has room the retry stores the record whole. Without the route cache's memory
    budget, which refuses such a write before Redis sees it (tests/route_cache/test_lifecycle.py):
    here Redis refuses it itself."""
    node = RedisProcess("--maxmemory", "4mb", "--maxmemory-policy", "noeviction").start()
    client = connect(node.url, cluster=False)
    store = RouteStore(client)
    config = Config(host="127.0.0.1", port=0, grace_s=1, memory_budget=0)
    server = RouteCacheServer(config, store).start()
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


def on_shard_of(client, node: RedisProcess, prefix: str) -> str:
    """A sample id whose record key lies in a slot ``node`` serves as a master."""
    ranges = victim_slot_ranges(node)
    return next(
        f"{prefix}-{i}"
        for i in range(10_000)
        if any(a <= client.keyslot(record_key(f"{prefix}-{i}")) <= b for a, b in ranges)
    )


# With WAIT, a write's script and its WAIT go over the key's master's own connection, which
# does not follow a failover as the cluster client's commands do. These appends were refused
# for ever (the old master answered MOVED, or could not be reached) until some other command
# refreshed the route cache's slot map: the first append after the failover must succeed.
# "manual": CLUSTER FAILOVER swaps master and replica (the old master answers MOVED).
# "kill": SIGKILL the master of a shard with two replicas (one is promoted, the other follows
# it, so WAIT 1 can succeed; the old master's address refuses connections).
@pytest.mark.parametrize("how", ["manual", "kill"])
def test_an_append_with_wait_follows_a_failover_at_once(how, rng):
    masters, replicas = start_cluster_with_replicas(3, 1 if how == "manual" else 2, 1000)
    client = connect(masters[1].url.rsplit("/", 1)[0], cluster=True)
    store = RouteStore(client, wait_replicas=1)
    victim = masters[0]
    heirs = replicas[: 1 if how == "manual" else 2]
    sample_id = on_shard_of(client, victim, f"follow-{how}")
    try:
        store.write(sample_id, "g", SMALL, block(rng, 0, 4))
        if how == "manual":
            redis.Redis(port=heirs[0].port).execute_command("CLUSTER FAILOVER")
            wait_promoted(heirs[0])
            wait_linked(victim)
        else:
            victim.kill()
            promoted = wait_promoted(*heirs)
            wait_linked(next(h for h in heirs if h is not promoted))
            wait_known(masters[1:] + replicas[2:], promoted)
        rows = 3
        for _ in range(3):  # the first append after the failover, and two more
            duplicate, rows = store.append(sample_id, SMALL, block(rng, rows, 2))
            assert not duplicate
        assert rows == 3 + 3 * 2
    finally:
        client.close()
        for node in masters + replicas:
            node.kill()


# The client's default retry policy rides through a Redis Cluster failover with the
# deployment's cluster-node-timeout (5 s). The defaults before (5 attempts, 0.75-1.5 s of
# pauses) gave up first: they run beside it as the control, through the same failover.
def test_default_retries_ride_through_a_failover_with_the_deployments_node_timeout():
    masters, replicas = start_cluster_with_replicas(3, 1, node_timeout_ms=5000)
    victim, heir = masters[0], replicas[0]
    client = connect(masters[1].url.rsplit("/", 1)[0], cluster=True, socket_connect_timeout=5)
    server = RouteCacheServer(
        Config(host="127.0.0.1", port=0, grace_s=1, health_interval_s=0.1), RouteStore(client)
    ).start()
    rng = np.random.default_rng(14)
    policies = {"default": None, "old": RetryPolicy(attempts=5, max_backoff_s=2.0)}
    sent = {
        name: synthetic_record(on_shard_of(client, victim, f"ride-{name}"), SMALL, 64, rng)
        for name in policies
    }
    outcome: dict[str, object] = {}

    def write(name: str) -> None:
        target = f"127.0.0.1:{server.port}"
        with RouteCacheClient(target, retry=policies[name], timeout_s=10) as cache:
            try:
                outcome[name] = cache.write(sent[name])
            except Exception as exc:  # noqa: BLE001 - asserted below
                outcome[name] = exc

    writers = [threading.Thread(target=write, args=(name,)) for name in policies]
    try:
        victim.kill()
        killed_at = time.monotonic()
        for thread in writers:
            thread.start()
        wait_promoted(heir)
        failover_s = time.monotonic() - killed_at
        for thread in writers:
            thread.join(60)
        print(f"failover {failover_s:.2f} s; outcomes {outcome}")
        assert failover_s > 5  # no failover before the node time-out: the writes had to wait
        assert isinstance(outcome["old"], Unavailable), outcome
        assert not isinstance(outcome["default"], Exception), outcome
        with RouteCacheClient(f"127.0.0.1:{server.port}") as cache:
            assert_same(cache.read(sent["default"].sample_id), sent["default"])
    finally:
        server.stop(0)
        client.close()
        for node in masters + replicas:
            node.kill()


def test_with_wait_an_announcement_is_on_the_replica_when_the_write_returns():
    """With --wait-replicas 1, the ready feed's announcement (XADD, on the stream's own shard)
    waits for that shard's replica like the record does: while the replica is SIGSTOPped the
    write is not answered; once it resumes, the entry is on the replica as the write returns.
    The record is on another shard, so only the announcement's WAIT holds the write back.
    An acknowledgement waits too, and is refused when WAIT falls short (a consumer told its
    group settled commits it); the consumer's retry, once the replica is back, counts it: the
    first attempt was applied, and the sample's claim names the consumer."""
    masters, replicas = start_cluster_with_replicas(3, 1, node_timeout_ms=5000)
    client = connect(masters[1].url.rsplit("/", 1)[0], cluster=True)
    store = RouteStore(client, wait_replicas=1, wait_timeout_ms=1500)
    config = Config(host="127.0.0.1", port=0, grace_s=1, health_interval_s=0.1)
    server = RouteCacheServer(config, store).start()
    shard = {m.port: r for m, r in zip(masters, replicas, strict=True)}
    stream_master = client.get_node_from_key(config.ready_stream)
    replica = shard[stream_master.port]
    record_on = next(m for m in masters if m.port != stream_master.port)
    record = synthetic_record(
        on_shard_of(client, record_on, "announced"), SMALL, 64, np.random.default_rng(15)
    )
    outcome: list = []

    def write() -> None:
        with RouteCacheClient(f"127.0.0.1:{server.port}", retry=RetryPolicy(attempts=1)) as c:
            outcome.append(c.write(record))

    on_replica = redis.Redis(port=replica.port)
    on_replica.execute_command("READONLY")
    writer = threading.Thread(target=write)
    try:
        replica.proc.send_signal(signal.SIGSTOP)
        writer.start()
        writer.join(0.7)
        assert writer.is_alive() and not outcome  # held back by the stopped replica
        replica.proc.send_signal(signal.SIGCONT)
        writer.join(10)
        assert outcome and outcome[0].sample_id == record.sample_id
        entries = on_replica.xrange(config.ready_stream)
        assert [f[b"sample_id"].decode() for _, f in entries] == [record.sample_id]

        with RouteCacheClient(f"127.0.0.1:{server.port}", retry=RetryPolicy(attempts=1)) as c:
            (entry,) = c.read_ready("trainers", "t0").entries
            replica.proc.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(Unavailable, match="0 of 1 replicas confirmed an acknowledgement"):
                c.ack_ready("trainers", [entry.entry_id], "t0")
            assert time.monotonic() - started >= 1.4  # it did wait for the replica
            replica.proc.send_signal(signal.SIGCONT)
            assert c.ack_ready("trainers", [entry.entry_id], "t0") == 1
            assert c.ack_ready("trainers", [entry.entry_id], "t1") == 0
    finally:
        if replica.proc.poll() is None:
            replica.proc.send_signal(signal.SIGCONT)
        server.stop(0)
        client.close()
        for node in masters + replicas:
            node.kill()
