"""The RL step in modes disabled / R2 / R3, its data plane and its consistency report.

Real megatron-core on the CPU, real rollout records (transformers float32 sampling and its
router top-k: the rollout server's contract, as measured, vLLM float32 == transformers), a
real route cache over the session Redis.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from routereplay.domain.record_file import load_records
from routereplay.domain.route_stats import agreement
from routereplay.errors import NotFound
from tests.trainer.helpers import capture_routing, one_hot
from tests.trainer.tolerance import loss_atol
from trainer import layout
from trainer.config import load_config
from trainer.data.source import BatchPlan, CacheSource, FileSource, Prefetcher, Sample
from trainer.layout.align import align_routes
from trainer.rl import measure, objective
from trainer.rl.step import RLStep
from trainer.train import build, train


def _config(tiny_model_dir, rollout_file, *overrides):
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.records_file={rollout_file}",
            "train.batch_size=8",
            *overrides,
        ],
    )


def _fetch(path, records):
    plan = BatchPlan([r.sample_id for r in records])
    return next(iter(Prefetcher(FileSource(path), [plan], "error")))


def _step(config, pg_collection, records):
    built, optimizer = build(config, pg_collection)
    stepper = RLStep(built, optimizer, config)
    return built, stepper, stepper.run(_fetch(config.data.records_file, records)).report


def _weights(built):
    return {n: p.detach().clone() for n, p in built.model.named_parameters()}


def test_r3_replaying_natural_identical_routes_is_bit_identical_to_disabled(
    tiny_model_dir, rollout_file, rollout, pg_collection
):
    # One micro-batch, one epoch: one optimizer step on a loss computed before any step.
    common = ("train.micro_batch_size=8", "train.ppo_epochs=1", "report.compare=false")
    runs = {}
    for mode in ("disabled", "R3"):
        config = _config(tiny_model_dir, rollout_file, f"router_replay.mode={mode}", *common)
        built, _, report = _step(config, pg_collection, rollout)
        runs[mode] = (report, _weights(built))
    (off, w_off), (r3, w_r3) = runs["disabled"], runs["R3"]
    assert r3.rows.replayed_fraction > 0.8 and off.rows.replayed == 0
    assert r3.agreement.exact == [1.0, 1.0, 1.0]
    assert r3.loss == off.loss
    assert r3.gap["replayed"].mean_abs == off.gap["natural"].mean_abs
    for name, w in w_off.items():
        assert torch.equal(w_r3[name], w), name


def test_r2_update_passes_replay_the_recorded_routes_after_optimizer_steps(
    tiny_model_dir, rollout_file, rollout, pg_collection, tmp_path
):
    # record_file: the step builds records of the routes it used only when they are written.
    config = _config(
        tiny_model_dir,
        rollout_file,
        "router_replay.mode=R2",
        "report.compare=false",
        "train.micro_batch_size=4",
        "train.ppo_epochs=2",
        "train.lr=0.01",
        f"router_replay.record_file={tmp_path / 'used.npz'}",
    )
    built, optimizer = build(config, pg_collection)
    stepper = RLStep(built, optimizer, config)
    fetched = _fetch(rollout_file, rollout)
    with capture_routing(built.routers) as (maps, _):
        result = stepper.run(fetched)
    report = result.report
    recorded = {r.sample_id: r for r in result.routes_used}
    mbs = layout.micro_batches(
        fetched.samples, fetched.records, np.zeros(8, np.float32), 4, "right"
    )
    layers = list(built.replay.layers)
    # Router calls: old-logprob pass (2 micro-batches), then 2 epochs x 2 micro-batches.
    assert all(len(calls) == 6 for calls in maps.values())
    for call in range(2, 6):
        mb = mbs[call % 2]
        aligned = align_routes(
            mb.batch, [recorded[s] for s in mb.batch.sample_ids], built.geometry, layers
        )
        rows = aligned.replayed.reshape(-1)
        for j, layer in enumerate(layers):
            expected = one_hot(aligned.indices[j][rows].long(), built.geometry.num_experts)
            assert torch.equal(maps[layer][call][rows], expected), (call, layer)
    # ... even though the optimizer steps moved the natural routing away from them.
    assert report.update_agreement[-1] < 0.99
    # The recorded routes are the trainer's natural ones, equal to the float32 rollout's.
    for r in rollout:
        np.testing.assert_array_equal(recorded[r.sample_id].routes, r.routes)


@pytest.mark.parametrize("side", ["right", "left"])
def test_micro_batches_pad_to_the_layouts_multiple(rollout_file, rollout, side):
    """Padded to the longest sample rounded up to the multiple; the extra columns are padding:
    never generated, no rollout log-prob, and the samples' tokens unmoved on their side."""
    fetched = _fetch(rollout_file, rollout)
    adv = np.zeros(8, np.float32)
    plain = layout.micro_batches(fetched.samples, fetched.records, adv, 4, side)
    padded = layout.micro_batches(fetched.samples, fetched.records, adv, 4, side, multiple=7)
    for a, b in zip(plain, padded, strict=True):
        seq, extra = a.batch.seq_len, b.batch.seq_len - a.batch.seq_len
        assert b.batch.seq_len % 7 == 0 and 0 <= extra < 7
        keep = slice(extra, None) if side == "left" else slice(0, seq)
        pad = slice(0, extra) if side == "left" else slice(seq, None)
        assert torch.equal(b.batch.token_ids[:, keep], a.batch.token_ids)
        assert torch.equal(b.generated[:, keep], a.generated)
        torch.testing.assert_close(
            b.rollout_logp[:, keep], a.rollout_logp, rtol=0, atol=0, equal_nan=True
        )
        assert not b.generated[:, pad].any() and b.rollout_logp[:, pad].isnan().all()
        assert torch.equal(b.batch.lengths, a.batch.lengths)
    assert any(b.batch.seq_len > a.batch.seq_len for a, b in zip(plain, padded, strict=True))


def test_replay_file_and_record_file_round_trip(
    tiny_model_dir, rollout_file, rollout, pg_collection, tmp_path
):
    out = tmp_path / "used.npz"
    config = _config(
        tiny_model_dir,
        rollout_file,
        "router_replay.mode=R3",
        f"router_replay.replay_file={rollout_file}",
        f"router_replay.record_file={out}",
        "data.records_file=null",
        "train.ppo_epochs=1",
        f"report.json={tmp_path / 'r.json'}",
    )
    ids = [r.sample_id for r in rollout]
    reports = train(config, [BatchPlan(ids)], pg_collection=pg_collection)
    assert reports[0].rows.replayed_fraction > 0.8
    assert (tmp_path / "r.json").exists()
    used = load_records(out)
    assert [u.sample_id for u in used] == ids
    for u, r in zip(used, rollout, strict=True):
        np.testing.assert_array_equal(u.routes, r.routes)
        np.testing.assert_array_equal(u.token_ids, r.token_ids)
        assert u.group_id == r.group_id and u.turns[0].generated_start == r.turns[0].generated_start


@pytest.fixture
def route_cache(redis_node, rollout):
    from route_cache.config import Config
    from route_cache.connection import connect
    from route_cache.server import RouteCacheServer
    from route_cache.store import RouteStore

    client = connect(redis_node.url, cluster=False)
    server = RouteCacheServer(
        Config(host="127.0.0.1", port=0, grace_s=1), RouteStore(client, ttl_ms=600_000)
    ).start()
    source = CacheSource(f"127.0.0.1:{server.port}")
    for record in rollout:
        source.client.write(record)
    yield source
    source.close()
    server.stop(0)
    client.close()


def test_prefetch_returns_batches_in_order_and_overlaps_training(route_cache, rollout):
    ids = [r.sample_id for r in rollout]
    plans = [BatchPlan(ids[i : i + 3]) for i in (0, 3, 5)]
    for prefetch in (True, False):
        fetcher = Prefetcher(route_cache, plans, "error", prefetch=prefetch)
        got = []
        for fetched in fetcher:
            got.append(fetched)
            time.sleep(0.3)  # a slow training step
        assert [[s.sample_id for s in f.samples] for f in got] == [p.sample_ids for p in plans]
        for f in got:
            for rec in f.records:
                np.testing.assert_array_equal(rec.routes, rollout[ids.index(rec.sample_id)].routes)
        events = {(what, i): t for what, i, t in fetcher.events}
        for i in (1, 2):
            ahead = events[("fetch_end", i)] < events[("wanted", i)]
            assert ahead is prefetch, (prefetch, i)
        if prefetch:  # the fetch was hidden: the loop did not wait for it
            assert max(f.wait_s for f in got[1:]) < 0.05


def test_missing_records_fail_or_train_natively(
    route_cache, rollout, tiny_model_dir, rollout_file, pg_collection
):
    ids = [r.sample_id for r in rollout[:4]] + ["nowhere-1"]
    with pytest.raises(NotFound, match="nowhere-1"):
        next(iter(Prefetcher(route_cache, [BatchPlan(ids)], "error")))
    # Known only by id: nothing to train on, dropped and counted.
    fetched = next(iter(Prefetcher(route_cache, [BatchPlan(ids)], "native")))
    assert fetched.missing == ["nowhere-1"] and fetched.dropped == ["nowhere-1"]
    assert len(fetched.samples) == 4
    # Samples from a feed: the one without a record trains with native routing.
    samples = [Sample.from_record(r) for r in rollout[:4]]
    orphan = Sample.from_record(rollout[4])
    orphan.sample_id = "nowhere-1"
    plan = BatchPlan(ids, samples + [orphan])
    fetched = next(iter(Prefetcher(route_cache, [plan], "native")))
    assert fetched.records[4] is None and fetched.dropped == []
    config = _config(
        tiny_model_dir,
        rollout_file,
        "router_replay.mode=R3",
        "train.micro_batch_size=5",
        "train.ppo_epochs=1",
        "router_replay.missing_record=native",
    )
    built, optimizer = build(config, pg_collection)
    report = RLStep(built, optimizer, config).run(fetched).report
    assert report.missing_records == 1
    routed = sum(r.token_ids.size - 1 for r in rollout[:4])
    assert report.rows.replayed == routed
    # Every row with a route, and only those, went where the rollout's route says, in the
    # old-logprob pass and the one update pass.
    followed = report.replay_followed
    assert followed.rows == [2 * routed] * 3 and followed.exact == [1.0] * 3
    assert report.rows.valid == routed + 4 + rollout[4].token_ids.size
    # The one optimizer step's gradient norm arrives with the step's updates.
    assert report.grad_norm is not None and len(report.grad_norm) == 1 and report.grad_norm[0] > 0


def test_metrics_match_an_independent_calculation(
    tiny_model_dir, rollout_file, rollout, pg_collection
):
    gap = measure.logprob_gap(np.array([-1.0, -2.0, -0.5]), np.array([-1.5, -2.0, 0.5]))
    d = np.array([0.5, 0.0, -1.0])
    assert gap.mean_abs == pytest.approx(0.5) and gap.max_abs == pytest.approx(1.0)
    assert gap.k3_kl == pytest.approx(np.mean(np.exp(d) - 1 - d))
    assert gap.ratio_gt_2 == pytest.approx(1 / 3)  # only |-1.0| > ln 2
    a = np.array([[[0, 1]], [[2, 3]], [[4, 5]]])
    b = np.array([[[1, 0]], [[2, 4]], [[6, 7]]])
    assert [float(x) for x in agreement([(a, b)]).exact] == [pytest.approx(1 / 3)]
    adv = objective.group_advantages([1.0, 0.0, 0.5, 0.2], ["g", "g", "h", "x"])
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0], atol=1e-5)

    # The step's gap against the rollout, recomputed sample by sample without padding.
    config = _config(tiny_model_dir, rollout_file, "router_replay.mode=disabled")
    built, optimizer = build(config, pg_collection)
    diffs = []
    with torch.no_grad():
        for r in rollout:
            tokens = torch.from_numpy(r.token_ids.astype(np.int64))[None]
            n = tokens.shape[1]
            mask = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
            logits = built.model(tokens, torch.arange(n)[None], mask)
            logp = torch.log_softmax(logits[0, :-1].double(), -1)
            picked = logp.gather(-1, tokens[0, 1:, None]).squeeze(-1).numpy()
            start = r.turns[0].generated_start
            diffs.append(picked[start - 1 :] - r.turns[0].logprobs)
    d = np.concatenate(diffs)
    report = RLStep(built, optimizer, config).run(_fetch(rollout_file, rollout)).report
    assert report.gap["natural"].tokens == d.size == 8 * 10
    assert report.gap["natural"].mean_abs == pytest.approx(np.abs(d).mean(), abs=1e-6)
    assert report.gap["natural"].max_abs == pytest.approx(np.abs(d).max(), abs=1e-6)
    # The rule: the fraction of generated ids that are multiples of 8.
    rewards = [float((r.token_ids[r.turns[0].generated_start :] % 8 == 0).mean()) for r in rollout]
    assert report.reward_mean == pytest.approx(np.mean(rewards))


def test_bf16_trainer_against_float32_rollout_replay_closes_the_gap(
    tiny_model_dir, rollout_file, rollout, pg_collection
):
    config = _config(
        tiny_model_dir,
        rollout_file,
        "router_replay.mode=R3",
        "train.dtype=bfloat16",
        "train.ppo_epochs=1",
    )
    _, _, report = _step(config, pg_collection, rollout)
    # bf16 flips near-ties: the trainer's natural routing misses the rollout's on some tokens,
    # while megatron's routing map under replay follows the rollout's routes on every row.
    assert min(report.agreement.exact) < 1.0
    assert report.replay_followed.exact == [1.0] * 3
    assert min(report.replay_followed.rows) > 0
    natural, replayed = report.gap["natural"], report.gap["replayed"]
    assert replayed.max_abs < natural.max_abs
    assert replayed.mean_abs < natural.mean_abs
    assert all(math.isfinite(v) for v in (report.loss, replayed.k3_kl))


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_replay_followed_checks_the_records_not_the_replay_ids(
    recompute, tiny_model_dir, rollout_file, rollout, pg_collection, monkeypatch
):
    """``replay_followed`` compares each router row with the record's row of its token, found
    from the model's inputs. Every replayed pass counts: the old-logprob pass, the 2 update
    epochs and, with activation recompute, each forward recomputed in backward. Replay ids
    one token off the records (an alignment fault, which the routers follow faithfully: a
    metric against the replay ids says 1.0) bring it below 1 on every layer."""
    config = _config(
        tiny_model_dir,
        rollout_file,
        "router_replay.mode=R3",
        "train.micro_batch_size=4",
        "train.ppo_epochs=2",
        f"model.recompute={str(recompute).lower()}",
    )
    routed = sum(r.num_rows for r in rollout)
    passes = 1 + 2 * (2 if recompute else 1)
    report = _step(config, pg_collection, rollout)[2]
    assert report.replay_followed.exact == [1.0] * 3
    assert report.replay_followed.rows == [passes * routed] * 3

    def shifted(batch, *args, **kwargs):
        """Each token gets the route of the token before it (megatron's [seq, rows] order)."""
        aligned = align_routes(batch, *args, **kwargs)
        aligned.indices = [torch.roll(i, batch.num_rows, dims=0) for i in aligned.indices]
        return aligned

    monkeypatch.setattr("trainer.layout.plan.align_routes", shifted)
    off = _step(config, pg_collection, rollout)[2]
    followed = off.replay_followed
    print(f"one token off: replay_followed {followed}, |d loss| {abs(off.loss - report.loss)}")
    assert followed.rows == [passes * routed] * 3
    assert max(followed.exact) < 0.5, followed
    # The layout tests' loss bound (tests/trainer/tolerance.py) catches the fault too:
    # mini-batches of 4 samples x 10 generated tokens, groups of 4.
    assert abs(off.loss - report.loss) > loss_atol(40, 4, 512)
