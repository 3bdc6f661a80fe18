"""What the verl tests share: rollout outputs in verl's form, a model with verl's router replay,
verl's own replay calls, and the check of every router's choice against the records."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from routereplay.domain.record import Record
from routereplay.families.model_geometry import MoEGeometry
from tests.trainer.helpers import capture_routing, one_hot
from trainer.layout.batch import PaddedBatch
from trainer.model.build import build_model
from trainer.model.hf_config import read_hf_config


def geometry_of(model_dir) -> MoEGeometry:
    from routereplay.families.model_geometry import geometry_from_config

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


def forced_record(model_dir, tokens, prompt_len: int, policy_version: int = 0) -> Record:
    """The call that produced ``tokens[prompt_len:]`` after ``tokens[:prompt_len]``, scripted:
    its rows are the model's own routes over ``tokens`` (teacher-forced), as vLLM captures a
    call's prompt and completion."""
    from transformers import AutoModelForCausalLM

    from routereplay.dev.hf_rollout import _forward_with_routes
    from routereplay.domain.record import Turn

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    sequence = torch.tensor([list(tokens)])
    with torch.no_grad():
        _, chosen = _forward_with_routes(model, sequence)
    routes = torch.stack([c.reshape(sequence.shape[1], -1) for c in chosen], dim=1)[:-1]
    geometry = geometry_of(model_dir).record
    turn = Turn(0, len(tokens), prompt_len, policy_version)
    tokens = np.asarray(tokens, dtype=np.int32)
    return Record("forced", geometry, tokens, routes.numpy().astype(geometry.dtype), [turn])


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


def engine_on_cpu(model_dir, pg_collection, cache: str, overrides: dict):
    """``RouteCacheEngine``, as verl's registry returns it for ``("language_model",
    "megatron")`` here, on the trainer's megatron model (R3), initialised on this rank.

    Replaced, because a CPU has no use for them (tests/verl/test_engine.py says why each):
    ``EngineRegistry.new``'s constructor (the class is verl's registry's; the instance is made
    with ``object.__new__`` and given the attributes verl's methods read), verl's
    ``MegatronEngine.initialize`` (mbridge, optimizer; the mix-in's own ``initialize`` runs
    over it), the CPU platform's ``current_device`` (``"cpu"``: ``forward_step``'s
    ``batch.to(get_device_id())`` takes 0 for ``cuda:0``) and verl's model forward function
    (``get_mcore_engine_forward_fn``: its THD path hands ``packed_seq_params`` to attention
    kernels the CPU lacks; the stand-in runs the same packed rows with a block-diagonal mask),
    and ``torch.cuda.synchronize`` (a no-op: megatron's variable-length p2p shape exchange,
    ``p2p_communication._communicate_shapes``, calls it after the gloo exchange).

    Returns:
        (engine, the ``TrainerModel``, ``calls``: the micro-batches' ids and rows (id, tokens,
        trains) in schedule order, the route source's builds and whether one ran inside
        megatron's schedule).
    """
    import os
    from types import SimpleNamespace

    import verl.models.mcore as mcore
    from verl.utils.device import get_platform
    from verl.workers.config import McoreEngineConfig, RouterReplayConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron import transformer_impl

    import verl_integration.engine as engine_module

    type(get_platform()).current_device = lambda self: "cpu"
    if not torch.cuda.is_available():  # megatron's p2p shape exchange ends with it
        torch.cuda.synchronize = lambda device=None: None
    os.environ["ROUTER_REPLAY_CACHE"] = cache
    engine_module.register_engine()
    cls = EngineRegistry.get_engine_cls("language_model", "megatron")
    built = verl_model(
        model_dir,
        pg_collection,
        load_weights=False,
        use_cpu_initialization=True,
        moe_token_dispatcher_type="allgather",
        **overrides,
    )
    for chunk in built.chunks:  # verl's schedule call: shapes go over p2p (TP1 here)
        chunk.config.variable_seq_lengths = True
    engine = object.__new__(cls)
    engine.engine_config = McoreEngineConfig(
        router_replay=RouterReplayConfig(mode="R3"), use_remove_padding=True, use_mbridge=True
    )
    engine.model_config = SimpleNamespace(
        local_path=str(model_dir),
        hf_config=SimpleNamespace(architectures=["Qwen3MoeForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        mtp=SimpleNamespace(enable=False, enable_train=False),
    )
    engine.enable_routing_replay = True
    engine.mini_layer_topk_idx_list = []

    calls = {
        "micro_batches": [],
        "micro_rows": [],
        "source_builds": 0,
        "source_built_in_schedule": False,
    }
    in_schedule = [False]

    def verl_initialize(self):  # verl's: tf_config and module from mbridge
        self.tf_config, self.module = built.chunks[0].config, built.chunks

    verl_source = engine_module.worker_source

    def worker_source(*args, **kwargs):
        calls["source_builds"] += 1
        calls["source_built_in_schedule"] |= in_schedule[0]
        source = verl_source(*args, **kwargs)
        moe = args[2].record.moe_layers
        calls["read_layers"] = None if source.layers is None else [moe[i] for i in source.layers]
        return source

    verl_schedule = transformer_impl.get_forward_backward_func

    def get_forward_backward_func():
        schedule = verl_schedule()

        def run(**kwargs):
            in_schedule[0] = True
            try:
                return schedule(**kwargs)
            finally:
                in_schedule[0] = False

        return run

    step = engine.forward_step

    def forward_step(batch_iter, model, *args, **kwargs):
        batch = next(batch_iter)
        calls["micro_batches"].append(_batch_ids(batch))
        calls["micro_rows"].append(_batch_rows(batch))
        return step(iter([batch]), model, *args, **kwargs)

    transformer_impl.MegatronEngine.initialize = verl_initialize
    transformer_impl.get_forward_backward_func = get_forward_backward_func
    engine_module.worker_source = worker_source
    mcore.get_mcore_engine_forward_fn = lambda hf_config: packed_forward
    engine.forward_step = forward_step
    engine.initialize()
    return engine, built, calls


def _batch_ids(batch) -> list[str | None]:
    from verl_integration.engine import row_ids

    return row_ids(batch)


def _batch_rows(batch) -> list[tuple[str | None, list[int], bool]]:
    """Each row of a micro-batch: its id, its tokens, whether its loss mask holds a token
    (verl's padding rows carry sample 0's id with other tokens, so the id alone is not enough)."""
    from verl_integration.engine import row_ids, trained_rows

    tokens = [t.tolist() for t in batch["input_ids"].unbind()]
    return list(zip(row_ids(batch), tokens, trained_rows(batch).tolist(), strict=True))


def packed_forward(model, input_ids, multi_modal_inputs, logits_processor=None, **kwargs):
    """verl's THD model forward (``gptmodel_forward_model_engine``) on the CPU: the
    micro-batch's sequences back to back in one row (verl packs them the same way for TP1,
    CP1: no alignment padding), attention block-diagonal; returns the log-probs of the next
    tokens, jagged like ``input_ids``, from the last stage."""
    from megatron.core.utils import unwrap_model

    ids = [str(i) for i in range(input_ids.shape[0])]
    batch = PaddedBatch.packed(ids, [t.cpu().numpy() for t in input_ids.unbind()])
    out = model(batch.token_ids, batch.position_ids(), batch.attention_mask())
    if not unwrap_model(model).post_process:
        return out
    labels = torch.roll(batch.token_ids, -1, dims=1)
    log_probs = torch.log_softmax(out.float(), -1).gather(-1, labels.unsqueeze(-1))[0, :, 0]
    lengths = input_ids.offsets().diff().tolist()
    return {"log_probs": nested(list(torch.split(log_probs, lengths)))}


def engine_batch(sample_ids: Sequence[str], tokens: Sequence[np.ndarray], v1: bool = False):
    """The batch verl's engine worker hands ``forward_backward_batch`` for an R3 forward (no
    padding: jagged ``input_ids``; dynamic batch size), the ids as verl's V0 path carries them
    (``DataProto.to_tensordict``: a ``route_cache_id`` column) or its V1 path
    (``list_of_dict_to_tensordict``: one ``extra_fields`` dict per sample)."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu

    from verl_integration.contract import ID_FIELD

    rows = [torch.as_tensor(np.asarray(t, dtype=np.int64)) for t in tokens]
    fields = {
        "input_ids": nested(rows),
        "loss_mask": nested([torch.ones(len(t), dtype=torch.int64) for t in rows]),
        "response_mask": torch.ones(len(rows), 4, dtype=torch.int64),
    }
    if v1:
        fields["extra_fields"] = NonTensorStack.from_list(
            [NonTensorData({ID_FIELD: s, "global_steps": 0}) for s in sample_ids]
        )
    else:
        fields[ID_FIELD] = NonTensorStack.from_list([NonTensorData(s) for s in sample_ids])
    data = tu.get_tensordict(fields)
    tu.assign_non_tensor(
        data,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=max(len(t) for t in rows) + 4,
        enable_routing_replay=True,
        temperature=1.0,
    )
    return data


def write_turns(writer, sample_id, policies, prompt, tool_tokens, new_tokens=4, prefix="call"):
    """One sample whose turn ``v`` policy ``policies[v]`` generated (the transformers rollout of
    the growing history: ``new_tokens`` per call, ``tool_tokens[v]`` answered after it), each
    call written through the rollout seam (``writer``: a ``TurnWriter``).

    Returns:
        Each call's record (the history so far plus its tokens, every row by its policy).
    """
    from routereplay.dev.hf_rollout import rollout_records

    history, calls = list(prompt), []
    for version, model_dir in enumerate(policies):
        call = rollout_records(
            model_dir,
            [history],
            group_size=1,
            new_tokens=new_tokens,
            seed=version,
            prefix=f"{prefix}{version}",
        )[0]
        writer.write(sample_id, history, token_output(call, len(history), version))
        calls.append(call)
        if version + 1 < len(policies):
            history = call.token_ids.tolist() + list(tool_tokens[version])
    return calls


def torchrun(layout: str, model_dir, records, cache: str, out, tails=None, batch=None):
    """``tests.verl.multirank`` on two gloo ranks (torchrun): ``layout`` over the records file
    (the oracle), the route cache at ``cache``, the engine's batch built from the records (and
    ``tails``) or loaded from ``batch`` (a saved ``TensorDict``); each rank writes
    ``{out}.rank{N}.json``."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [
        shutil.which("torchrun", path=str(Path(sys.executable).parent)),
        *("--standalone", "--nproc-per-node", "2", "-m", "tests.verl.multirank"),
        *("--layout", layout, "--model-dir", str(model_dir), "--records", str(records)),
        *("--cache", cache, "--out", str(out)),
        *(("--tails", json.dumps(tails)) if tails is not None else ()),
        *(("--batch", str(batch)) if batch is not None else ()),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)
