"""The routing oracle, independent of vLLM: teacher-force tokens through transformers.

``prompt + generated[:-1]`` through the Hugging Face model (float32); the experts each MoE
layer's router chose (its own top-k: softmax, or GLM-4.5's biased, group-limited sigmoid
choice), by global layer number, are what the engine must have routed, compared as sets.
"""

from __future__ import annotations

import numpy as np


def load_hf_model(model_dir):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            # vLLM's CPU kernel computes with gpt-oss's sinks in bfloat16 (rollout_server
            # cpu_sinks): a no-op for the tiny model's, not for a trained step's.
            sinks = getattr(layer.self_attn, "sinks", None)
            if sinks is not None:
                sinks.copy_(sinks.bfloat16().float())
    return model.eval()


def oracle(hf_model, geometry, token_ids):
    """Teacher-force ``token_ids`` through transformers.

    Returns:
        routes: top-k experts per MoE layer, ``[len(token_ids), num_moe_layers, topk]``.
        logprobs: ``[len(token_ids), vocab]`` log-softmax of the next-token logits.
    """
    import torch

    from routereplay.dev.hf_rollout import hf_routers

    chosen: dict[int, torch.Tensor] = {}
    handles = [
        router.register_forward_hook(
            lambda m, i, o, n=n: chosen.__setitem__(n, o[2].detach().clone())
        )
        for n, router in hf_routers(hf_model).items()
    ]
    try:
        with torch.no_grad():
            out = hf_model(torch.tensor([list(token_ids)]))
    finally:
        for h in handles:
            h.remove()
    assert sorted(chosen) == list(geometry.moe_layers)
    top = [chosen[layer].reshape(len(token_ids), geometry.topk) for layer in geometry.moe_layers]
    logprobs = out.logits[0].log_softmax(-1)
    return torch.stack(top, dim=1).numpy(), logprobs.numpy()


def agreement(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per MoE layer, the share of rows whose top-k sets are equal. ``[num_moe_layers]``."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return (np.sort(got, -1) == np.sort(want, -1)).all(-1).mean(0)


def assert_record_matches(hf_model, record):
    """A record read back from the cache equals the oracle on every row and MoE layer,
    prompt rows included, and its generated tokens' log-probs equal transformers'."""
    tokens = record.token_ids.tolist()
    routes, logprobs = oracle(hf_model, record.geometry, tokens[:-1])
    same = agreement(record.routes, routes)
    assert (same == 1.0).all(), f"agreement per MoE layer: {same}"
    for turn in record.turns:
        if turn.logprobs.size:
            positions = np.arange(turn.generated_start - 1, turn.token_end - 1)
            ref = logprobs[positions, record.token_ids[turn.generated_start : turn.token_end]]
            np.testing.assert_allclose(turn.logprobs, ref, atol=1e-4)
