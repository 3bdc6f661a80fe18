"""One rank of the verl integration's multi-rank check; launched by tests/verl/test_multirank.py:

    torchrun --standalone --nproc-per-node 2 -m tests.verl.multirank --layout tp2sp \
        --model-dir DIR --records FILE --cache HOST:PORT --out PREFIX

Every rank builds the tiny model in the layout with verl's router replay patch, fetches its
samples through ``verl_integration.fetch`` (``worker_source``: only its stage's MoE layers, one
read per TP group), hands the field to verl's own align, mask and ``set_router_replay_data`` and
forwards the THD-packed batch (megatron's pipeline schedule under PP2); a hook on each router
checks every row it holds against the rollout's records (read from the records file the test
wrote, not through the route cache). Each rank writes ``PREFIX.rank{N}.json``.
"""

from __future__ import annotations

import argparse
import json
import traceback

import numpy as np
import torch

from tests.verl.cpu import use_cpu

LAYOUTS = {
    "tp2sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2),
    "engine_pp2": dict(pp=2),
    "engine_pp2_v1": dict(pp=2),
    "engine_pp2_batch": dict(pp=2),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--layout", "--model-dir", "--records", "--cache", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--tails", default="[]")
    parser.add_argument("--batch", default=None)
    args = parser.parse_args()
    use_cpu()
    torch.set_num_threads(1)
    import torch.distributed as dist

    result: dict = {}
    try:
        result = run_engine(args) if args.layout.startswith("engine") else run(args)
    except Exception:
        result = {"error": traceback.format_exc()}
        raise
    finally:
        rank = dist.get_rank() if dist.is_initialized() else -1
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(result, f)


def run(args) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from routereplay.domain.record_file import load_records
    from tests.verl.helpers import check_rows, geometry_of, nested, replay_r3, verl_model
    from trainer.distributed.world import init_world, model_overrides
    from trainer.layout.batch import PaddedBatch
    from trainer.sharding import Parallelism
    from verl_integration.fetch import RouteFetcher, worker_source

    layout = Parallelism(**LAYOUTS[args.layout])
    world = init_world(layout)
    torch.manual_seed(1234)
    built = verl_model(
        args.model_dir,
        world.pg_collection,
        load_weights=False,
        use_cpu_initialization=True,
        moe_token_dispatcher_type="allgather",
        **model_overrides(layout),
    )
    geometry = geometry_of(args.model_dir)
    records = load_records(args.records)
    ids = [r.sample_id for r in records]
    tokens = [torch.from_numpy(r.token_ids.astype(np.int64)) for r in records]

    source = worker_source(args.cache, built.chunks, geometry)
    routes = RouteFetcher(source, geometry).routes(ids, nested(tokens)).routed_experts
    moe = geometry.record.moe_layers
    mine = sorted(r.layer for r in built.routers)
    others = [layer for layer in moe if layer not in mine]
    batch = PaddedBatch.packed(ids, [r.token_ids for r in records], multiple=layout.tp)
    labels = torch.roll(batch.token_ids, -1, dims=1)
    response_mask = torch.ones(len(records), 2)

    def forward_step(data_iterator, model):
        next(data_iterator)
        replay_r3(model, routes, nested(tokens), response_mask, model.config)
        out = model(batch.token_ids, batch.position_ids(), batch.attention_mask(), labels=labels)
        return out, lambda loss: (loss.sum(), {"loss": loss.sum().detach()})

    from tests.trainer.helpers import capture_routing

    with torch.no_grad(), capture_routing(built.routers) as (maps, logits):
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(range(1))],
            model=built.chunks,
            num_microbatches=1,
            seq_length=batch.seq_len,
            micro_batch_size=1,
            forward_only=True,
        )
    maps = {k: v[0] for k, v in maps.items()}
    logits = {k: v[0] for k, v in logits.items()}
    share = batch.seq_len // layout.tp if layout.sequence_parallel else batch.seq_len
    tp_rank = world.coords.tp_rank
    rows = range(tp_rank * share, (tp_rank + 1) * share)

    def expected(b, p, layer):
        r = records[b]
        return r.routes[p, moe.index(layer)] if p < r.num_rows else None

    replayed, natural, bad = check_rows(
        maps,
        logits,
        batch,
        expected,
        native=lambda b, p: p == records[b].num_tokens - 1,
        topk=geometry.record.topk,
        rows=rows,
    )
    fetched_other = any(bool(t[:, others].any()) for t in routes.unbind()) if others else False
    return {
        "rank": world.rank,
        "pp_rank": world.coords.pp_rank,
        "tp_rank": tp_rank,
        "router_layers": mine,
        "read_layers": None if source.layers is None else [moe[i] for i in source.layers],
        "read_from_cache": source.reads,
        "other_stage_columns_nonzero": fetched_other,
        "rows": [rows.start, rows.stop],
        "replayed": replayed,
        "natural": natural,
        "bad": bad[:20],
    }


def run_engine(args) -> dict:
    """verl's own ``MegatronEngineWithLMHead.forward_backward_batch`` and ``forward_step`` (R3,
    megatron's pipeline schedule) in ``RouteCacheEngine``, the engine verl's registry returns
    here; the batch as verl's engine worker hands it over. What is replaced (``engine_on_cpu``)
    and why: tests/verl/test_engine.py's module docstring."""
    import numpy as np

    from routereplay.domain.record_file import load_records
    from tests.trainer.helpers import capture_routing
    from tests.verl.helpers import check_rows, engine_batch, engine_on_cpu, geometry_of
    from trainer.distributed.world import init_world, model_overrides
    from trainer.layout.batch import PaddedBatch
    from trainer.sharding import Parallelism

    layout = Parallelism(**LAYOUTS[args.layout])
    world = init_world(layout)
    torch.manual_seed(1234)
    geometry = geometry_of(args.model_dir)
    records = load_records(args.records)  # the oracle: every row's route as generated
    tails = json.loads(args.tails)  # per sample, tokens after the record (a tool's answer)
    tokens = [
        np.concatenate([r.token_ids.astype(np.int64), np.asarray(t, dtype=np.int64)])
        for r, t in zip(records, tails, strict=True)
    ]
    engine, built, calls = engine_on_cpu(
        args.model_dir, world.pg_collection, args.cache, model_overrides(layout)
    )
    if args.batch:  # the batch verl's trainer hands its workers (a saved TensorDict)
        from verl.utils import tensordict_utils as tu

        data = torch.load(args.batch, weights_only=False)
        longest = int(data["input_ids"].offsets().diff().max())
        tu.assign_non_tensor(
            data,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=longest + 4,
            enable_routing_replay=True,
            temperature=1.0,
        )
    else:
        data = engine_batch([r.sample_id for r in records], tokens, v1=args.layout.endswith("v1"))
    moe = geometry.record.moe_layers
    with capture_routing(built.routers) as (maps, logits), torch.no_grad():
        output = engine.forward_backward_batch(data, None, forward_only=True)
    by_id = {r.sample_id: r for r in records}
    replayed = natural = untrained = 0
    bad: list[str] = []
    for c, micro in enumerate(calls["micro_rows"]):
        rows = [np.asarray(t) for _, t, _ in micro]
        batch = PaddedBatch.packed([str(b) for b in range(len(micro))], rows)
        oracle = [by_id[i] if trains else None for i, _, trains in micro]
        untrained += sum(1 for r in oracle if r is None)

        def expected(b, p, layer, oracle=oracle):
            r = oracle[b]
            return r.routes[p, moe.index(layer)] if r is not None and p < r.num_rows else None

        rep, nat, wrong = check_rows(
            {k: v[c] for k, v in maps.items()},
            {k: v[c] for k, v in logits.items()},
            batch,
            expected,
            native=lambda b, p, oracle=oracle: oracle[b] is None or p >= oracle[b].num_rows,
            topk=geometry.record.topk,
        )
        replayed, natural, bad = replayed + rep, natural + nat, bad + wrong
    report = engine.route_report._asdict() if engine.route_report else None
    return {
        "rank": world.rank,
        "pp_rank": world.coords.pp_rank,
        "router_layers": sorted(r.layer for r in built.routers),
        "engine_class": type(engine).__name__,
        "micro_batches": calls["micro_batches"],
        "source_builds": calls["source_builds"],
        "source_built_in_schedule": calls["source_built_in_schedule"],
        "read_layers": calls["read_layers"],
        "replayed": replayed,
        "natural": natural,
        "bad": bad[:20],
        "untrained_rows": untrained,
        "report": report,
        "metrics": sorted(output.get("metrics", {})) if output else None,
        "log_probs": sorted(output.get("model_output", {}).keys()) if output else None,
    }


if __name__ == "__main__":
    main()
