"""``data.source=feed``: the trainer takes its batches from the route cache's ready feed.

A real route cache (gRPC on a socket) over a real redis-server, the rollout's records written
through it (each write announced on the feed), and the real trainer: one rank in this process,
and two data-parallel or tensor-parallel ranks under torchrun. The oracle is the same training
on the same sample ids given as a list (``data.source=ids``), whose single-rank, DP and TP runs
are tested elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from route_cache.config import Config
from route_cache.connection import connect
from route_cache.record_format import dead_letter_key, record_key, routes_key
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.domain.record_checks import MISSING_RECORD_REASON
from routereplay.errors import RouteReplayError
from routereplay.rpc.client import RouteCacheClient
from routereplay.rpc.ready import ReadyConsumer
from routereplay.rpc.security import ClientSecurity, ServerSecurity
from tests.trainer.helpers import assert_same_counts
from tests.trainer.tolerance import loss_atol
from trainer.config import ConfigError, load_config
from trainer.data.source import BatchPlan, FeedPlans
from trainer.distributed.dp import DataParallel, ModelParallel
from trainer.report.outputs import FeedAck
from trainer.report.step_report import reports_from_json
from trainer.sharding import Parallelism, RankCoords
from trainer.train import train

ROOT = Path(__file__).resolve().parents[3]


class Cache:
    """A route cache server with a ready stream of its own, on the session's redis-server."""

    def __init__(self, redis_url: str, token_file: str = ""):
        self.redis = connect(redis_url, cluster=False)
        self.stream = f"rr:ready:{uuid.uuid4().hex[:8]}"
        config = Config(
            host="127.0.0.1",
            port=0,
            grace_s=1,
            health_interval_s=0.1,
            ready_stream=self.stream,
            ready_max_block_ms=5000,
            security=ServerSecurity(auth_token_file=token_file),
        )
        self.server = RouteCacheServer(config, RouteStore(self.redis, ttl_ms=600_000)).start()
        self.target = f"127.0.0.1:{self.server.port}"
        security = ClientSecurity(token_file=token_file)
        self.client = RouteCacheClient(self.target, timeout_s=30, security=security)

    def pending(self, group: str) -> int:
        return int(self.redis.xpending(self.stream, group)["pending"])

    def close(self) -> None:
        self.client.close()
        self.server.stop(0)
        self.redis.close()


@pytest.fixture
def cache(redis_node):
    cache = Cache(redis_node.url)
    yield cache
    cache.close()


def _groups(rollout) -> list[list]:
    by_group: dict[str, list] = {}
    for record in rollout:
        by_group.setdefault(record.group_id, []).append(record)
    return list(by_group.values())


def _config(tiny_model_dir, target, *overrides):
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"route_cache.target={target}",
            "router_replay.mode=R3",
            "train.batch_size=4",
            "train.micro_batch_size=2",
            "train.steps=2",
            "data.wait_s=20",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def ids_reports(tiny_model_dir, rollout, pg_collection, redis_node):
    """The oracle: the two groups trained as lists of ids, one step each."""
    cache = Cache(redis_node.url)
    try:
        for record in rollout:
            cache.client.write(record)
        plans = [BatchPlan([r.sample_id for r in g]) for g in _groups(rollout)]
        return train(_config(tiny_model_dir, cache.target), plans, pg_collection=pg_collection)
    finally:
        cache.close()


def test_feed_batches_are_whole_groups_trained_once_then_acknowledged(
    tiny_model_dir, rollout, pg_collection, ids_reports, cache
):
    first, second = _groups(rollout)
    for record in first[:3]:
        cache.client.write(record)
    cache.client.write(first[0])  # a retried write: announced twice
    for record in [first[3], *second, second[1]]:
        cache.client.write(record)
    config = _config(tiny_model_dir, cache.target, "data.source=feed", "data.group_size=4")
    reports = train(config, None, pg_collection=pg_collection)

    assert [r.feed.groups for r in reports] == [[first[0].group_id], [second[0].group_id]]
    assert all(r.feed.rollout_versions == [0] for r in reports)
    for got, want in zip(reports, ids_reports, strict=True):
        assert_same_counts(got, want)
        assert got.loss == pytest.approx(want.loss, abs=1e-6)
    assert cache.pending("trainer") == 0  # every entry acknowledged, the repeats included


def test_a_restarted_trainer_gets_back_what_it_had_not_acknowledged(
    tiny_model_dir, rollout, pg_collection, ids_reports, cache
):
    first, _ = _groups(rollout)
    for record in first:
        cache.client.write(record)
    # A trainer that read the group and died before its optimizer step: the entries stay
    # pending under its consumer name in Redis.
    crashed = ReadyConsumer(cache.client, "job", "trainer-a", 4, block_ms=200)
    assert [g.sample_ids for g in crashed.next_groups(1, timeout_s=10)] == [
        [r.sample_id for r in first]
    ]
    assert cache.pending("job") == 4

    overrides = [
        "data.source=feed",
        "data.group_size=4",
        "data.consumer_group=job",
        "data.consumer=trainer-a",
        "train.steps=1",
    ]
    reports = train(
        _config(tiny_model_dir, cache.target, *overrides), None, pg_collection=pg_collection
    )
    assert [r.feed.groups for r in reports] == [[first[0].group_id]]
    assert reports[0].reward_mean == ids_reports[0].reward_mean
    assert cache.pending("job") == 0


def test_the_run_ends_when_no_whole_batch_comes(tiny_model_dir, rollout, pg_collection, cache):
    first, _ = _groups(rollout)
    for record in first[:3]:  # a group that never completes
        cache.client.write(record)
    config = _config(
        tiny_model_dir, cache.target, "data.source=feed", "data.group_size=4", "data.wait_s=1"
    )
    assert train(config, None, pg_collection=pg_collection) == []
    assert cache.pending("trainer") == 3  # still there for a later consumer


@pytest.mark.parametrize(
    "layout",
    [["parallel.dp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"]],
    ids=["dp2", "tp2sp"],
)
def test_two_ranks_share_one_consumer(
    layout, tiny_model_dir, rollout, ids_reports, cache, tmp_path
):
    """Rank 0 reads the feed and hands the batch to rank 1: under DP2 each sample is trained
    once, by one rank; under TP2 both ranks train the whole batch, each its shard of the model.
    The step equals the single-rank step on the same ids."""
    for record in rollout:
        cache.client.write(record)
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    head = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    command = [
        *head,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "trainer",
        f"model.path={tiny_model_dir}",
        f"route_cache.target={cache.target}",
        "router_replay.mode=R3",
        "train.batch_size=4",
        "train.micro_batch_size=2",
        "data.source=feed",
        "data.group_size=4",
        "data.wait_s=20",
        *layout,
        "--steps",
        "2",
        "--report",
        str(tmp_path / "report.json"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    reports = reports_from_json(json.loads((tmp_path / "report.json").read_text()))
    groups = [[g[0].group_id] for g in _groups(rollout)]
    assert [r.feed.groups for r in reports] == groups  # one consumer read them, in order
    for got, want in zip(reports, ids_reports, strict=True):
        assert got.samples == 4  # not 8: no sample trained twice (DP) or counted twice (TP)
        assert_same_counts(got, want)
        # Another layout: 2 samples of 10 generated tokens per mini-batch, groups of 4.
        assert got.loss == pytest.approx(want.loss, abs=loss_atol(20, 4, 512))
    assert cache.pending("trainer") == 0


@pytest.mark.parametrize(("dp_rank", "tp_rank"), [(0, 0), (0, 1), (1, 0)])
def test_only_the_lead_reads_the_feed(dp_rank, tp_rank, tiny_model_dir, cache):
    """One consumer per job: the TP ranks of DP rank 0 share its DP rank but only TP rank 0
    reads (the others get the batch by broadcast; two readers would split or repeat groups)."""
    layout = Parallelism(tp=2, sequence_parallel=True)
    mp = ModelParallel(layout, RankCoords(tp_rank=tp_rank), tp_group=None, expert_dp_group=None)
    dp = DataParallel(2, dp_rank, model=mp)
    config = _config(tiny_model_dir, cache.target, "data.source=feed", "data.group_size=4")
    feed = FeedPlans(config, dp, cache.client)
    assert (feed.consumer is not None) == (dp_rank == tp_rank == 0)
    feed.close()


def test_a_route_cache_that_wants_a_token_gets_the_configured_one(
    tiny_model_dir, rollout, pg_collection, redis_node, tmp_path
):
    token = tmp_path / "token"
    token.write_text(uuid.uuid4().hex)
    cache = Cache(redis_node.url, token_file=str(token))
    try:
        first, _ = _groups(rollout)
        for record in first:
            cache.client.write(record)
        feed = ["data.source=feed", "data.group_size=4", "train.steps=1"]
        with pytest.raises(RouteReplayError, match="token"):
            train(_config(tiny_model_dir, cache.target, *feed), None, pg_collection=pg_collection)
        config = _config(tiny_model_dir, cache.target, *feed, f"route_cache.token_file={token}")
        reports = train(config, None, pg_collection=pg_collection)
        assert [r.feed.groups for r in reports] == [[first[0].group_id]]
    finally:
        cache.close()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.source=file"], "data.source='file'"),
        (["data.source=feed", "route_cache.target="], "needs route_cache.target"),
        (["data.source=feed", "data.group_size=3"], "must be >= 1 and divide"),
        (["push.targets=localhost:1"], "needs train.export_dir"),
    ],
)
def test_bad_feed_settings_are_refused(overrides, message):
    base = ["model.path=m", "route_cache.target=localhost:1", "train.batch_size=4"]
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*base, *overrides])


def test_a_published_sample_whose_record_is_gone_is_dead_lettered_and_the_rest_trains(
    tiny_model_dir, rollout, pg_collection, cache
):
    """Issue 47: a record lost after its announcement (here deleted straight from Redis: it
    stands for a failover without WAIT, or a restart without AOF) used to fail its batch under
    ``missing_record=error`` on every restart. Now the sample trains nothing, goes to the
    dead-letter stream with its reason, the batch trains the other three, and nothing stays
    pending (a restarted job would not meet it again)."""
    first, _ = _groups(rollout)
    for record in first:
        cache.client.write(record)
    lost = first[1].sample_id
    cache.redis.delete(record_key(lost), routes_key(lost))
    config = _config(
        tiny_model_dir, cache.target, "data.source=feed", "data.group_size=4", "train.steps=1"
    )
    (report,) = train(config, None, pg_collection=pg_collection)
    assert report.feed.groups == [first[0].group_id]
    assert report.dropped_samples == 1 and report.missing_records == 1
    dead = cache.redis.xrange(dead_letter_key(cache.stream))
    assert [(f[b"sample_id"].decode(), f[b"consumer_group"].decode()) for _, f in dead] == [
        (lost, "trainer")
    ]
    assert dead[0][1][b"reason"].decode() == MISSING_RECORD_REASON
    assert cache.pending("trainer") == 0
    assert cache.server.feed.dead_lettered == 1


def test_a_dead_letter_of_a_job_killed_before_its_acknowledgement_is_settled_on_resume(
    tiny_model_dir, rollout, pg_collection, cache, tmp_path, monkeypatch
):
    """A job killed after a step's checkpoint and before its acknowledgement: the resumed job
    acknowledges the step's entries from the feed log (it must not train them again), and
    the sample whose record was gone reaches the dead-letter stream then, with its reason:
    the dead letters are logged before the checkpoint (``DeadLetters``)."""
    first, _ = _groups(rollout)
    for record in first:
        cache.client.write(record)
    lost = first[2].sample_id
    cache.redis.delete(record_key(lost), routes_key(lost))
    config = _config(
        tiny_model_dir,
        cache.target,
        "data.source=feed",
        "data.group_size=4",
        "train.steps=1",
        f"train.checkpoint_dir={tmp_path / 'ckpt'}",
    )
    with monkeypatch.context() as killed:  # the kill: no acknowledgement, no closing one
        killed.setattr(FeedAck, "after_step", lambda self, done: None)
        killed.setattr(FeedPlans, "close", lambda self: self.log.close())
        (report,) = train(config, None, pg_collection=pg_collection)
    assert report.dropped_samples == 1
    assert cache.pending("trainer") == 4 and not cache.redis.exists(dead_letter_key(cache.stream))
    assert train(config, None, pg_collection=pg_collection) == []  # the checkpoint covers it
    dead = cache.redis.xrange(dead_letter_key(cache.stream))
    assert [f[b"sample_id"].decode() for _, f in dead] == [lost]
    assert dead[0][1][b"reason"].decode() == MISSING_RECORD_REASON
    assert cache.pending("trainer") == 0
