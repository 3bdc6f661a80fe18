"""What the verl tests share: rollout outputs in verl's form, a model with verl's router replay,
verl's own replay calls, and the check of every router's choice against the records."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from routereplay.domain.model_geometry import MoEGeometry
from routereplay.domain.record import Record
from tests.trainer.helpers import capture_routing, one_hot
from trainer.layout.batch import PaddedBatch
from trainer.model.build import build_model
from trainer.model.hf_config import read_hf_config


def geometry_of(model_dir) -> MoEGeometry:
    from routereplay.domain.model_geometry import geometry_from_config

    return geometry_from_config(read_hf_config(model_dir), "tiny")


def engine_capture(record: Record, num_hidden_layers: int, dense_fill: int = 7) -> np.ndarray:
    """The record's routes as vLLM returns them: int32 ``[T - 1, num_hidden_layers, k]``, dense
    layers' columns filled with ``dense_fill`` (whatever the engine puts there is never read)."""
    rows, _, k = record.routes.shape
    out = np.full((rows, num_hidden_layers, k), dense_fill, dtype=np.int32)
    out[:, list(record.geometry.moe_layers)] = record.routes
    return out


def token_output(record: Record, prompt_len: int, policy_version: int = 0):
    """verl's ``TokenOutput`` of the ``generate()`` call that produced ``record``."""
    from verl.workers.rollout.replica import TokenOutput

    return TokenOutput(
        token_ids=record.token_ids[prompt_len:].tolist(),
        log_probs=record.turns[-1].logprobs.tolist() or None,
        routed_experts=engine_capture(record, _num_hidden_layers(record)),
        extra_fields={"global_steps": policy_version},
    )


def _num_hidden_layers(record: Record) -> int:
    return record.geometry.moe_layers[-1] + 1  # the tiny models end with a MoE layer


def verl_model(model_dir, pg_collection=None, **overrides):
    """The trainer's megatron model with verl's router replay (``apply_router_replay_patch``
    before the build, as verl's Megatron engine does; the project's own replay not installed)."""
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    apply_router_replay_patch()
    return build_model(
        model_dir,
        routing_replay=False,
        pg_collection=pg_collection,
        moe_enable_routing_replay=True,
        **overrides,
    )


def nested(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def replay_r3(model, routed_experts, input_ids, response_mask, tf_config, mask_hook=None):
    """verl's Megatron forward step for R3: align, mask, set the routers' targets."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import (
        align_r3_router_replay_data,
        build_r3_replay_mask,
        set_model_router_replay_action,
        set_router_replay_data,
    )

    set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
    aligned = align_r3_router_replay_data(routed_experts, input_ids)
    mask = build_r3_replay_mask(input_ids, response_mask)
    if mask_hook is not None:
        mask = mask_hook(mask)
    set_router_replay_data(aligned, None, tf_config, 0, replay_mask=mask, model=model)


def forward_packed(built, batch: PaddedBatch):
    """Forward ``batch`` (THD-packed, as verl's engine feeds it) and return each router's
    routing map and gating logits (its only call): ``{layer: bool [rows, experts]}``, ``{layer:
    float [rows, experts]}``, rows of this rank (its sequence-parallel share)."""
    with torch.no_grad(), capture_routing(built.routers) as (maps, logits):
        built.model(batch.token_ids, batch.position_ids(), batch.attention_mask())
    return {k: v[0] for k, v in maps.items()}, {k: v[0] for k, v in logits.items()}


def check_rows(maps, logits, batch: PaddedBatch, expected, native, topk: int, rows=None):
    """Compare every router's choice with ``expected`` on the replayed rows and with its own
    top-k on the ``native`` ones.

    Args:
        maps, logits: ``forward_packed``'s.
        batch: The packed batch (row r of the pack is sample b's token r - packed_starts[b]).
        expected: ``expected(b, position, layer)`` -> the recorded expert ids, or None.
        native: ``native(b, position)`` -> True where the router must choose natively.
        rows: ``range`` of pack rows this rank holds (default: all).

    Returns:
        (replayed rows compared, native rows compared, mismatches as strings).
    """
    replayed = natural = 0
    bad = []
    rows = rows or range(batch.seq_len)
    for layer, routing_map in maps.items():
        num_experts = routing_map.shape[1]
        own = one_hot(torch.topk(logits[layer], topk, dim=-1).indices, num_experts)
        for b, (start, n) in enumerate(
            zip(batch.packed_starts.tolist(), batch.lengths.tolist(), strict=True)
        ):
            for p in range(n):
                r = start + p
                if r not in rows:
                    continue
                local = r - rows.start
                ids = expected(b, p, layer)
                if ids is not None:
                    want = one_hot(torch.as_tensor(ids).reshape(1, -1), num_experts)[0]
                    replayed += 1
                elif native(b, p):
                    want = own[local]
                    natural += 1
                else:
                    continue
                if not torch.equal(routing_map[local], want):
                    bad.append(f"layer {layer} sample {b} position {p}")
    return replayed, natural, bad
