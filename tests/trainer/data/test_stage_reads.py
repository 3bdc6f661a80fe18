"""Stage reads (``trainer.data.stage_reads``): each (DP rank, pipeline stage) reads its
stage's layers once and shares them with its TP/CP group.

The 4-rank run (TP2+SP x PP2, real megatron-core on gloo, a real route cache over a
redis-server) is held against the route cache's own byte counter and against the same run
reading whole records on every rank: the same arithmetic, so the same losses exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from route_cache.config import Config
from route_cache.connection import connect
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.domain.record import Geometry, Record, Turn
from routereplay.domain.record_file import load_records
from routereplay.rpc.client import RouteCacheClient
from tests.trainer.helpers import assert_same_step
from trainer.data.stage_reads import pack_records, unpack_records
from trainer.report.step_report import StepReport, reports_from_json

ROOT = Path(__file__).resolve().parents[3]
SERVED = "route_cache_route_bytes_served_total"


def _record(sample_id: str, tokens: int, dtype, layers=None) -> Record:
    rng = np.random.default_rng(tokens)
    experts = 300 if dtype == np.uint16 else 16
    geometry = Geometry((1, 2, 4), 2, experts, "m")
    routes = np.stack([rng.permutation(experts)[:2] for _ in range((tokens - 1) * 3)])
    routes = routes.reshape(tokens - 1, 3, 2).astype(dtype)
    if layers is not None:
        routes = np.ascontiguousarray(routes[:, list(layers)])
    turns = [
        Turn(0, 3, 2, 0, rng.random(1, np.float32)),
        Turn(3, tokens, 3, 5, rng.random(tokens - 3, np.float32)),
    ]
    token_ids = rng.integers(0, 100, tokens, dtype=np.int32)
    return Record(sample_id, geometry, token_ids, routes, turns, "g", layers)


def test_records_pack_into_one_buffer_and_back_unchanged():
    records = [
        _record("a", 7, np.uint8, (0, 2)),
        None,
        _record("b", 4, np.uint16),
        _record("c", 5, np.uint8, (1,)),
    ]
    header, payload = pack_records(records)
    assert payload.dtype == np.uint8 and payload.ndim == 1
    assert payload.size >= sum(r.routes.nbytes for r in records if r is not None)
    got = unpack_records(header, payload.copy())
    assert got[1] is None
    for a, b in zip(got, records, strict=True):
        if b is None:
            continue
        assert (a.sample_id, a.group_id, a.geometry, a.layers) == (
            b.sample_id,
            b.group_id,
            b.geometry,
            b.layers,
        )
        for x, y in ((a.token_ids, b.token_ids), (a.routes, b.routes)):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
        assert [
            (t.token_start, t.token_end, t.generated_start, t.policy_version) for t in a.turns
        ] == [(t.token_start, t.token_end, t.generated_start, t.policy_version) for t in b.turns]
        for s, t in zip(a.turns, b.turns, strict=True):
            np.testing.assert_array_equal(s.logprobs, t.logprobs)
    assert unpack_records(*pack_records([])) == []


def test_a_stage_record_aligns_as_the_whole_records_columns_and_needs_its_layers():
    import dataclasses

    from routereplay.errors import InvalidArgument
    from trainer.layout.align import align_routes
    from trainer.layout.batch import PaddedBatch

    whole = [_record("a", 7, np.uint8), _record("b", 5, np.uint8)]
    # MoE layers (1, 2, 4): a second stage holding positions 1 and 2, layers 2 and 4.
    stage = [
        dataclasses.replace(r, routes=np.ascontiguousarray(r.routes[:, [1, 2]]), layers=(1, 2))
        for r in whole
    ]
    geometry = whole[0].geometry
    for side in ("right", "left"):
        batch = PaddedBatch.from_samples(
            ["a", "b"], [r.token_ids for r in whole], padding_side=side
        )
        want = align_routes(batch, whole, geometry, [2, 4])
        got = align_routes(batch, stage, geometry, [2, 4])
        for x, y in zip(got.indices, want.indices, strict=True):
            assert torch.equal(x, y)
        assert torch.equal(got.replayed, want.replayed)
        with pytest.raises(InvalidArgument, match=r"holds layers \[2, 4\], not \[1\]"):
            align_routes(batch, stage, geometry, [1, 2])


@pytest.fixture(scope="module")
def cache(tiny_model_dir, redis_node):
    """A route cache holding 8 rollout samples of the tiny model (3 MoE layers); yields
    (server, target, records)."""
    pytest.importorskip("megatron.core")
    from routereplay.dev.hf_rollout import random_prompts, rollout_records

    prompts = random_prompts(2, [5, 8], 512, seed=3)
    records = rollout_records(
        tiny_model_dir, prompts, group_size=4, new_tokens=8, seed=0, prefix=f"stage-{os.getpid()}"
    )
    store = RouteStore(connect(redis_node.url, cluster=False))
    server = RouteCacheServer(Config(host="127.0.0.1", port=0, grace_s=1), store).start()
    target = f"127.0.0.1:{server.port}"
    with RouteCacheClient(target) as client:
        for record in records:
            client.write(record)
    yield server, target, records
    server.stop(0)


def _run(model_dir, target, ids, out: Path, *extra) -> list[StepReport]:
    """2 R3 steps of 4 samples under TP2+SP x PP2 (4 ranks) from the route cache."""
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    head = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    args = [
        *head,
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "trainer",
        f"model.path={model_dir}",
        f"route_cache.target={target}",
        "router_replay.mode=R3",
        "train.batch_size=4",
        "train.micro_batch_size=2",
        "train.ppo_epochs=1",
        "report.compare=false",
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        f"router_replay.record_file={out / 'used.npz'}",
        *extra,
        "--ids",
        ",".join(ids),
        "--steps",
        "2",
        "--report",
        str(out / "r.json"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    out.mkdir()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return reports_from_json(json.loads((out / "r.json").read_text()))


@pytest.mark.slow
def test_tp2sp_pp2_reads_each_stored_route_byte_once_and_trains_as_whole_reads(
    tiny_model_dir, cache, tmp_path
):
    server, target, records = cache
    registry = server.metrics.registry
    ids = [r.sample_id for r in records]
    # RAW encoding (the client's default): stored route bytes are the routes' bytes.
    stored = [sum(r.routes.nbytes for r in records[s * 4 : (s + 1) * 4]) for s in range(2)]

    served = {}
    runs = {}
    for name, extra in (("stage", []), ("whole", ["data.stage_reads=false"])):
        before = registry.get_sample_value(SERVED) or 0.0
        runs[name] = _run(tiny_model_dir, target, ids, tmp_path / name, *extra)
        served[name] = registry.get_sample_value(SERVED) - before

    # The route cache's own count, against the stored bytes of the batches read.
    assert served["stage"] <= 1.05 * sum(stored), (served, stored)
    assert served["whole"] == 4 * sum(stored)  # every rank a whole record: TP x PP
    # Each step's reads, as the trainer counted them: the stored bytes of its batch.
    for name, factor in (("stage", 1), ("whole", 4)):
        assert [r.route_bytes.batch for r in runs[name]] == stored
        assert [r.route_bytes.read for r in runs[name]] == [factor * s for s in stored]
        assert sum(r.route_bytes.read for r in runs[name]) == served[name]

    for got, want in zip(runs["stage"], runs["whole"], strict=True):
        assert_same_step(got, want)
        assert got.reward_mean == want.reward_mean
        assert got.replay_followed == want.replay_followed
        assert set(got.replay_followed.exact) == {1.0}
    # The routes used, written by the lead, are the rollout's whole records.
    used = load_records(tmp_path / "stage" / "used.npz")
    assert [r.sample_id for r in used] == ids
    for got, want in zip(used, records, strict=True):
        assert got.layers is None
        np.testing.assert_array_equal(got.routes, want.routes)


def _share(rank: int, port: int, target: str, ids: list[str], out: str) -> None:
    """One rank of a 2-rank gloo world: rank 0 reads, rank 1 gets the records by broadcast."""
    import torch.distributed as dist

    from routereplay.errors import InvalidArgument
    from trainer.data.source import CacheSource
    from trainer.data.stage_reads import StageReads

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        source = CacheSource(target)
        shared = StageReads(source, [1, 2], group, src=0)
        assert shared.reads == (rank == 0)
        records = shared.fetch([*ids, "nowhere"])
        assert records[-1] is None
        np.savez(f"{out}/{rank}.npz", *[r.routes for r in records[:-1]])
        # A read the route cache refuses fails on both ranks, with its message.
        beyond = StageReads(source, [1, 99], group, src=0)
        try:
            beyond.fetch(ids)
        except InvalidArgument as exc:
            assert "layers" in str(exc), exc
        else:
            raise AssertionError("the bad layer selection was not refused")
        source.close()
    finally:
        dist.destroy_process_group()


def test_one_rank_reads_the_layers_and_the_other_gets_the_same_records(redis_node, tmp_path):
    import torch.multiprocessing as mp

    from routereplay.dev.launch import free_port
    from routereplay.dev.synthetic import QWEN3_30B_A3B, synthetic_record

    store = RouteStore(connect(redis_node.url, cluster=False))
    server = RouteCacheServer(Config(host="127.0.0.1", port=0, grace_s=1), store).start()
    target = f"127.0.0.1:{server.port}"
    rng = np.random.default_rng(0)
    records = [
        synthetic_record(f"share-{os.getpid()}-{i}", QWEN3_30B_A3B, n, rng)
        for i, n in enumerate((40, 7))
    ]
    try:
        with RouteCacheClient(target) as client:
            for record in records:
                client.write(record)
        ids = [r.sample_id for r in records]
        mp.spawn(_share, args=(free_port(), target, ids, str(tmp_path)), nprocs=2)
    finally:
        server.stop(0)
    for rank in (0, 1):
        got = np.load(tmp_path / f"{rank}.npz")
        for i, record in enumerate(records):
            np.testing.assert_array_equal(got[f"arr_{i}"], record.routes[:, [1, 2]])
