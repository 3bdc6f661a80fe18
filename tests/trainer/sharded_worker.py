"""One rank of a sharded-weights check; launched by tests/trainer/model/test_sharded_weights.py as

    torchrun --standalone --nproc-per-node N -m tests.trainer.sharded_worker \
        --layout tp2sp --model-dir DIR --out FILE

Every rank loads its share of the Hugging Face checkpoint (``build_model``: one chunk, or one
per virtual stage) and runs the same 4 samples as 2 micro-batches through megatron's own
schedule, forward only (1F1B or interleaved with PP, no pipelining without), natural routing.
Each rank gathers its vocabulary slices of the logits and its sequence shards of the routing
maps over its TP group, and sends them to rank 0, which runs transformers on each sample alone
and writes, as JSON to ``--out``: the largest |logit difference| over every rank holding
logits, whether argmax agrees, and per MoE layer the tokens whose top-k expert set differs from
transformers' on any rank holding that layer. Before that, each rank gathers its share back
(``shard_weights.full_weights``): rank 0 records whether every gathered tensor equals the
checkpoint's bit for bit and whether the ranks together gave back every tensor of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch
import torch.distributed as dist

from tests.trainer.helpers import capture_routing, one_hot
from tests.trainer.model.test_model_parity import _hf_reference
from tests.trainer.multirank_pp import MICRO_BATCH, _micro_batches
from tests.trainer.multirank_worker import LENGTHS, SEED, _gather_tp
from trainer.distributed.world import World, init_world, model_overrides
from trainer.model.build import build_model
from trainer.model.hf_config import read_checkpoint_config
from trainer.model.hf_weights import hf_to_megatron, load_hf_state_dict
from trainer.model.shard_weights import full_weights
from trainer.sharding import Parallelism, padded_length

LAYOUTS = {
    "tp2sp": Parallelism(tp=2, sequence_parallel=True),
    "ep2": Parallelism(ep=2),
    "tp2sp_ep2": Parallelism(tp=2, ep=2, etp=1, sequence_parallel=True),
    "pp2": Parallelism(pp=2),
    "pp2_vp2": Parallelism(pp=2, vp=2),
    # 4 ranks.
    "tp2sp_pp2": Parallelism(tp=2, pp=2, sequence_parallel=True),
}


def _build(model_dir: str, layout: Parallelism, world: World):
    """This rank's model chunks (one without virtual stages) and their routers."""
    overrides = model_overrides(layout)
    built = build_model(
        model_dir, routing_replay=False, pg_collection=world.pg_collection, **overrides
    )
    return built.chunks, built.routers


def _forward(models, micro_batches) -> list[torch.Tensor]:
    """Logits ``[b, s, V / tp]`` per micro-batch (last pipeline stage; empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        batch = micro_batches[next(data_iterator)][1]
        logits = model(batch.token_ids, batch.position_ids(), batch.attention_mask())
        return logits, lambda out: (out.sum() * 0, {"logits": out.detach()})

    with torch.no_grad():
        stored = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(range(len(micro_batches))) for _ in models],
            model=models if len(models) > 1 else models[0],
            num_microbatches=len(micro_batches),
            seq_length=micro_batches[0][1].seq_len,
            micro_batch_size=MICRO_BATCH,
            forward_only=True,
        )
    return [d["logits"] for d in stored]


def _gather_vocab(t: torch.Tensor, tp_group) -> torch.Tensor:
    size = dist.get_world_size(tp_group)
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def run(layout_name: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    layout = LAYOUTS[layout_name]
    world = init_world(layout, seed=SEED)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    models, routers = _build(model_dir, layout, world)
    full = hf_to_megatron(load_hf_state_dict(model_dir), read_checkpoint_config(model_dir))
    back = {name: t for model in models for name, t in full_weights(model).items()}
    for model in models:
        model.eval()
    micro_batches = _micro_batches(padded_length(max(LENGTHS), layout.multiple))
    with capture_routing(routers) as (maps, _):
        logits = _forward(models, micro_batches)
    local = {
        "logits": [_gather_vocab(x, tp_group) for x in logits],
        "maps": {layer: [_gather_tp(m, tp_group) for m in calls] for layer, calls in maps.items()},
        "gathered": sorted(back),
        "gathered_equal": all(torch.equal(t, full[name]) for name, t in back.items()),
    }
    gathered = [None] * world.world_size if world.rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if world.rank == 0:
        result = _compare(gathered, micro_batches, model_dir)
        result.update(layout=layout_name, world_size=world.world_size)
        result["gathered_equal"] = all(g["gathered_equal"] for g in gathered)
        result["gathered_complete"] = {n for g in gathered for n in g["gathered"]} == set(full)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _compare(gathered, micro_batches, model_dir: str) -> dict:
    """Rank 0: every rank's logits and routing maps against transformers, sample by sample."""
    samples = [
        (mb, i, batch) for mb, (_, batch) in enumerate(micro_batches) for i in range(MICRO_BATCH)
    ]
    reference = _hf_reference(
        model_dir, [batch.sample_tokens(i).numpy() for _, i, batch in samples]
    )
    worst, argmax_equal, ranks_with_logits = 0.0, True, 0
    mismatched: dict[int, int] = {}  # per layer, over every rank holding it
    for got in gathered:
        ranks_with_logits += bool(got["logits"])
        for (mb, i, batch), (ref_logits, ref_topk) in zip(samples, reference, strict=True):
            n = int(batch.lengths[i])
            if got["logits"]:
                ours = got["logits"][mb][i, :n]
                worst = max(worst, float((ours - ref_logits).abs().max()))
                argmax_equal &= torch.equal(ours.argmax(-1), ref_logits.argmax(-1))
            for layer, calls in got["maps"].items():
                # Routing map rows are tokens in [seq, batch] order.
                routing = calls[mb].view(batch.seq_len, batch.batch_size, -1)[:n, i]
                expected = one_hot(ref_topk[layer], routing.shape[-1])
                bad = int((routing != expected).any(dim=1).sum())
                mismatched[layer] = mismatched.get(layer, 0) + bad
    return {
        "max_dlogit": worst,
        "argmax_equal": argmax_equal,
        "ranks_with_logits": ranks_with_logits,
        "mismatched_tokens": mismatched,
        "layers": sorted(mismatched),
        "hf_moe_layers": sorted(reference[0][1]),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        run(args.layout, args.model_dir, args.out)
    except Exception:
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()
