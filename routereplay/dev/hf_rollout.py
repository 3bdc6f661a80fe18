"""A reference rollout with transformers: records of the rollout's contract without vLLM.

For tests, the benchmark and local runs without the rollout server. As measured, vLLM in
float32 agrees with transformers in float32 on 100% of routes, so this is what the rollout
server would store for the same samples (a real vLLM run is the main job's end-to-end test).

Each prompt is sampled ``group_size`` times (one GRPO group); every sample is then teacher-forced
through the same model to read, per token, the experts each MoE layer's router chose (row i computed
with token i as input; the final token has no row) and the log-probability of each generated
token, exactly what a rollout record holds. ``dtype=torch.bfloat16`` gives a bf16 rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from routereplay.domain.record import Record, Turn
from routereplay.families.model_geometry import load_geometry


def rollout_records(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    group_size: int,
    new_tokens: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    prefix: str = "s",
    policy_version: int = 0,
    model_id: str | None = None,
) -> list[Record]:
    """Sample ``group_size`` completions of ``new_tokens`` tokens per prompt; one record each.

    Args:
        model_dir: The Hugging Face checkpoint folder (what the rollout server serves).
        prompts: Token ids per prompt.
        group_size: Samples per prompt (their ``group_id`` is shared).
        new_tokens: Generated tokens per sample (exactly this many: EOS does not stop early).
        seed: Sampling seed.
        dtype: The rollout's precision.
        prefix: Sample ids are ``{prefix}-p{prompt}-g{sample}``, groups ``{prefix}-p{prompt}``.
        policy_version: Stored in each record's turn.
        model_id: The geometry's model id (default: the folder's name).

    Returns:
        Records in prompt-major order, validated.
    """
    from transformers import AutoModelForCausalLM

    geometry = load_geometry(model_dir, model_id or Path(model_dir).name).record
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    torch.manual_seed(seed)
    records = []
    for p, prompt in enumerate(prompts):
        prompt_ids = torch.tensor([list(prompt)] * group_size, dtype=torch.int64)
        with torch.no_grad():
            sequences = model.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                do_sample=True,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=model.config.pad_token_id,
            )
            out, chosen = _forward_with_routes(model, sequences)
        n, total = sequences.shape
        # chosen: one [n * total, topk] tensor per MoE layer, in layer order.
        routes = torch.stack([c.reshape(n, total, geometry.topk) for c in chosen], dim=2)[:, :-1]
        logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
        picked = logp.gather(-1, sequences[:, 1:, None]).squeeze(-1)
        start = len(prompt)
        for g in range(n):
            turn = Turn(
                0,
                total,
                start,
                policy_version,
                picked[g, start - 1 :].numpy().astype(np.float32),
            )
            record = Record(
                f"{prefix}-p{p}-g{g}",
                geometry,
                sequences[g].numpy().astype(np.int32),
                routes[g].numpy().astype(geometry.dtype),
                [turn],
                f"{prefix}-p{p}",
            )
            record.validate()
            records.append(record)
    return records


def hf_routers(model) -> dict[int, torch.nn.Module]:
    """A transformers MoE model's routers by global layer number (``mlp.gate``; gpt-oss
    ``mlp.router``). Every family's returns (logits, weights, expert ids) of its own choice."""
    from routereplay.families import family_named

    name = family_named(model.config.model_type).weights.router
    return {
        n: getattr(layer.mlp, name)
        for n, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, name)
    }


def _forward_with_routes(model, sequences: torch.Tensor):
    """The model's output and, per MoE layer in order, the experts its router chose (its own
    top-k: softmax, or GLM-4.5's biased, group-limited sigmoid choice), ``[tokens, topk]``."""
    chosen: dict[int, torch.Tensor] = {}
    handles = [
        router.register_forward_hook(
            lambda m, i, o, n=n: chosen.__setitem__(n, o[2].detach().clone())
        )
        for n, router in hf_routers(model).items()
    ]
    try:
        out = model(sequences)
    finally:
        for h in handles:
            h.remove()
    return out, [chosen[n] for n in sorted(chosen)]


def random_prompts(count: int, lengths: Sequence[int], vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of token ids in ``[2, vocab)``, lengths cycling through ``lengths``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, lengths[i % len(lengths)]).tolist() for i in range(count)]
