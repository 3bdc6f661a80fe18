"""The trainer seam inside verl's Megatron engine (``verl_integration.engine``).

Through verl's own code: ``EngineRegistry`` (which class verl's worker builds), the batch as
verl's two paths carry the ids (``DataProto.to_tensordict``, ``list_of_dict_to_tensordict``),
and, under PP2 on megatron's pipeline schedule (torchrun, 2 gloo ranks,
``tests/verl/multirank.py``), verl's ``MegatronEngine.forward_backward_batch`` (micro-batch
split by token count, the schedule) and ``MegatronEngineWithLMHead.forward_step`` (R3: align,
replay mask, ``set_router_replay_data``) in the class verl's registry returns.

What the engine run replaces, and why (``tests.verl.helpers.engine_on_cpu``):

- the constructor: ``EngineRegistry.new`` would run ``MegatronEngine.__init__``, which asserts
  ``use_mbridge`` and builds the model through mbridge from an ``HFModelConfig``; the instance is
  made with ``object.__new__`` from the class verl's ``get_engine_cls`` returns, given the
  attributes verl's methods read (a real ``McoreEngineConfig`` with R3; a model config stub);
- verl's ``MegatronEngine.initialize`` (mbridge build, optimizer, checkpoint manager): replaced
  by one that sets ``tf_config`` and ``module`` (the trainer's megatron model with verl's
  router replay patch); ``RouteCacheEngine.initialize`` runs over it unchanged;
- the CPU platform's ``current_device`` returns ``"cpu"``: ``forward_step``'s first line,
  ``batch = batch.to(get_device_id())``, reads 0 as ``cuda:0``;
- verl's model forward (``get_mcore_engine_forward_fn`` -> ``gptmodel_forward_model_engine``):
  its THD path passes ``packed_seq_params`` to the attention, which megatron's CPU attention
  (``DotProductAttention``) refuses; the stand-in packs the same rows back to back (as verl
  does at TP1, CP1) with a block-diagonal mask and returns next-token log-probs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from routereplay.dev.hf_rollout import random_prompts, rollout_records
from routereplay.dev.tiny_model import build_tiny_model
from routereplay.domain.record_file import save_records
from routereplay.errors import InvalidArgument
from routereplay.rpc.client import RouteCacheClient
from tests.verl.cpu import needs_verl
from tests.verl.helpers import token_output, torchrun, write_turns
from verl_integration.contract import ID_FIELD, served_geometry
from verl_integration.rollout import TurnWriter

needs_verl()
ROOT = Path(__file__).resolve().parents[2]


# --- registration (fault 1) ----------------------------------------------------------------


@pytest.fixture
def registry(monkeypatch):
    """verl's registry as its own modules left it (without the plugin's registration, made when
    verl's Megatron engine was imported), restored afterwards."""
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401  (verl's registrations)
    from verl.workers.engine.base import EngineRegistry

    from verl_integration.engine import engine_class

    engines = {
        m: {b: {key: c for key, c in k.items() if c is not engine_class()} for b, k in v.items()}
        for m, v in EngineRegistry._engines.items()
    }
    monkeypatch.setattr(EngineRegistry, "_engines", engines)
    return EngineRegistry


@pytest.mark.parametrize("platform", [None, ("cuda", "nvidia")], ids=["cpu", "cuda-nvidia"])
def test_verls_registry_returns_the_route_cache_engine(registry, monkeypatch, platform):
    """On this platform and on a GPU's key (verl's own ``VERL_ENGINE_DEVICE`` / ``_VENDOR``
    override), where verl's ``MegatronEngineWithLMHead`` holds the device-only ``"cuda"`` key:
    registering there again would trip verl's assert; the ``(device, vendor)`` key is looked up
    first, so ``EngineRegistry.new`` (verl's worker) builds ``RouteCacheEngine``."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from verl_integration.engine import register_engine

    if platform:
        monkeypatch.setenv("VERL_ENGINE_DEVICE", platform[0])
        monkeypatch.setenv("VERL_ENGINE_VENDOR", platform[1])
        assert registry.get_engine_cls("language_model", "megatron") is MegatronEngineWithLMHead
    cls = register_engine()
    assert cls.__name__ == "RouteCacheEngine" and issubclass(cls, MegatronEngineWithLMHead)
    assert registry.get_engine_cls("language_model", "megatron") is cls
    assert register_engine() is cls  # idempotent: the plugin runs in every process
    assert cls not in registry._engines["value_model"]["megatron"].values()


def test_a_key_held_by_another_engine_is_refused_naming_it(registry):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from verl_integration.engine import engine_key, register_engine

    class OtherPluginEngine(MegatronEngineWithLMHead):
        pass

    registry.register("language_model", "megatron", *engine_key())(OtherPluginEngine)
    with pytest.raises(RuntimeError, match="OtherPluginEngine.*another plugin's engine"):
        register_engine()


# --- sample ids in verl's two paths (fault 4) ----------------------------------------------


def test_ids_from_verls_v0_column_and_v1_extra_fields():
    """V0: ``DataProto.to_tensordict`` makes each ``extra_fields`` key a column. V1:
    ``list_of_dict_to_tensordict`` keeps one ``extra_fields`` dict per sample."""
    from verl.protocol import DataProto
    from verl.utils import tensordict_utils as tu

    from verl_integration.engine import sample_ids

    ids = ["s0", "s1", "s2"]
    v0 = DataProto.from_dict(
        tensors={"responses": torch.zeros(3, 2, dtype=torch.int64)},
        non_tensors={ID_FIELD: np.array(ids, dtype=object)},
    ).to_tensordict()
    v1 = tu.list_of_dict_to_tensordict(
        [
            {"input_ids": torch.arange(n), "extra_fields": {ID_FIELD: s, "global_steps": 2}}
            for n, s in zip((3, 5, 4), ids, strict=True)
        ]
    )
    assert sample_ids(v0) == sample_ids(v1) == ids
    # verl's micro-batch split keeps them in row order.
    assert sample_ids(tu.index_select_tensor_dict(v1, [2, 0])) == ["s2", "s0"]
    assert sample_ids(tu.index_select_tensor_dict(v0, [1])) == ["s1"]

    v1_without = tu.list_of_dict_to_tensordict(
        [{"input_ids": torch.arange(3), "extra_fields": {"global_steps": 2}}]
    )
    with pytest.raises(InvalidArgument, match=f"has no '{ID_FIELD}' for row"):
        sample_ids(v1_without)
    with pytest.raises(InvalidArgument, match=f"neither a '{ID_FIELD}' column.*'extra_fields'"):
        sample_ids(tu.get_tensordict({"input_ids": torch.zeros(2, 3)}))


# --- verl's engine under PP2 (faults 2 and 5) ----------------------------------------------

SAMPLE = "eng-three-turns"
PROMPT = [17, 230, 41, 99, 5]
TOOL_TOKENS = [[301, 302, 303], [404, 405], [506, 507, 508]]  # the last: after the last turn


@pytest.fixture(scope="module")
def engine_records(tiny_model_dir, route_cache, tmp_path_factory):
    """A three-turn sample whose turns three policies generated (three seeds of the tiny
    model, each call the transformers rollout of the growing history), ending with a tool's
    answer no call ran; two one-turn samples. Written through the rollout seam; the oracle file
    holds each row's route from the call that generated its token."""
    geometry = served_geometry(str(tiny_model_dir))
    policies = [tiny_model_dir] + [
        build_tiny_model(tmp_path_factory.mktemp(f"eng-policy{v}"), seed=v) for v in (1, 2)
    ]
    one_turn = rollout_records(
        tiny_model_dir,
        random_prompts(1, [6], 512, seed=9),
        group_size=2,
        new_tokens=5,
        seed=4,
        prefix="eng-one",
    )
    with RouteCacheClient(route_cache) as client:
        writer = TurnWriter(client, geometry)
        calls = write_turns(writer, SAMPLE, policies, PROMPT, TOOL_TOKENS, prefix="eng-call")
        for r in one_turn:
            start = r.turns[0].generated_start
            writer.write(r.sample_id, r.token_ids[:start].tolist(), token_output(r, start))
    per_turn = np.stack(
        [next(c for c in calls if i < c.num_rows).routes[i] for i in range(calls[-1].num_rows)]
    )
    three = dataclasses.replace(calls[-1], sample_id=SAMPLE, routes=per_turn)
    records = [one_turn[0], three, one_turn[1]]
    path = save_records(tmp_path_factory.mktemp("eng") / "records.npz", records)
    return path, records, calls, [[], TOOL_TOKENS[2], []]


@pytest.mark.slow
def test_verls_engine_replays_each_turns_policy_under_pp2(
    engine_records, tiny_model_dir, route_cache, tmp_path
):
    """verl's ``forward_backward_batch`` and ``forward_step`` in ``RouteCacheEngine`` (V1
    batch: ids in ``extra_fields``), PP2 on megatron's schedule: every router of both stages
    chooses, on every row of every micro-batch, the experts the policy that generated that
    row's token chose (the three-turn sample's turns: three policies); the tool's answer after
    the last generation and each sample's last token route natively (verl's mask alone would
    replay the answer's rows as expert 0). The route source was built in ``initialize()``, once
    per rank, never inside the schedule; each stage read only its own MoE layers."""
    path, records, calls, tails = engine_records
    out = tmp_path / "engine"
    proc = torchrun("engine_pp2_v1", tiny_model_dir, path, route_cache, out, tails)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    assert proc.returncode == 0, (ranks, proc.stderr[-6000:])
    for r in ranks:
        assert r["engine_class"] == "RouteCacheEngine"
        assert not r["bad"], r["bad"]
        assert r["source_builds"] == 1 and not r["source_built_in_schedule"]
        assert r["read_layers"] == r["router_layers"]
        # verl's dynamic batch split: more than one micro-batch, every sample once.
        assert len(r["micro_batches"]) > 1
        assert sorted(sum(r["micro_batches"], [])) == sorted(x.sample_id for x in records)
    assert [r["router_layers"] for r in ranks] == [[1], [2, 3]]
    assert ranks[1]["log_probs"] == ["log_probs"]
    rows = sum(x.num_rows for x in records)
    native = len(records) + len(TOOL_TOKENS[2])  # last tokens, and the answer's rows
    assert [r["replayed"] for r in ranks] == [rows, 2 * rows]
    assert [r["natural"] for r in ranks] == [native, 2 * native]
    # The earlier turns' rows really differ between policies (the case verl #6054 loses).
    earlier = slice(0, calls[1].num_rows)
    last_policy = calls[-1].routes[earlier]
    own = records[1].routes[earlier]
    assert (np.sort(last_policy, -1) != np.sort(own, -1)).any(-1).mean() > 0.3


# --- disaggregated prefill/decode: routes through Ray (issue 45) ----------------------------


def test_ray_routes_with_the_route_cache_on_are_refused_unless_told(
    route_cache, tiny_model_dir, monkeypatch, caplog
):
    """verl builds disaggregated prefill/decode replicas without the registry the plugin
    converts, so their R3 routes reach the trainer through Ray (``batch["routed_experts"]``). With
    the route cache on, ``RouteCacheEngine.forward_backward_batch`` (the registry's class) refuses
    such a batch naming the setting, before verl's runs; with ``ROUTER_REPLAY_RAY_ROUTES=use`` it
    warns and hands verl's ``forward_backward_batch`` the batch with Ray's routes unchanged.
    Stood in: verl's ``forward_backward_batch`` (a recorder: what is checked is the batch that
    reaches it) and the constructor (``object.__new__``, as in ``engine_on_cpu``)."""
    from verl.workers.config import McoreEngineConfig, RouterReplayConfig

    from routereplay.errors import FailedPrecondition
    from tests.verl.helpers import engine_batch, nested
    from trainer.data.source import CacheSource
    from verl_integration.engine import RouteCacheEngineMixin, register_engine
    from verl_integration.fetch import RouteFetcher

    monkeypatch.setenv("ROUTER_REPLAY_CACHE", route_cache)
    cls = register_engine()
    engine = object.__new__(cls)
    engine.engine_config = McoreEngineConfig(
        router_replay=RouterReplayConfig(mode="R3"), use_remove_padding=True, use_mbridge=True
    )
    engine.route_fetcher = RouteFetcher(
        CacheSource(route_cache), served_geometry(str(tiny_model_dir))
    )
    tokens = [np.arange(2, 9), np.arange(3, 8)]
    data = engine_batch(["pd-0", "pd-1"], tokens)
    ray_routes = nested([torch.ones(len(t), 4, 2, dtype=torch.int16) for t in tokens])
    data["routed_experts"] = ray_routes
    with pytest.raises(FailedPrecondition, match="through Ray.*ROUTER_REPLAY_RAY_ROUTES=use"):
        engine.forward_backward_batch(data, None, forward_only=True)

    seen = []
    verl_cls = cls.__mro__[cls.__mro__.index(RouteCacheEngineMixin) + 1]
    monkeypatch.setattr(
        verl_cls,
        "forward_backward_batch",
        lambda self, d, loss_function, forward_only=False: seen.append(d["routed_experts"]),
    )
    monkeypatch.setenv("ROUTER_REPLAY_RAY_ROUTES", "use")
    with caplog.at_level("WARNING", logger="verl_integration.engine"):
        engine.forward_backward_batch(data, None, forward_only=True)
    assert seen == [ray_routes] and "through Ray" in caplog.text
    assert engine.route_report is None  # nothing fetched


def test_verls_pd_replica_is_said_loudly_up_to_where_a_gpu_is_needed(monkeypatch, caplog):
    """``get_rollout_replica_class("vllm", disaggregation_enabled=True)``, verl's, as its
    ``LLMServerManager`` calls it (``llm_server``'s own binding): with the route cache
    configured, the plugin logs an error naming the setting; without it, nothing. verl then
    imports ``vLLMPDReplica``, whose ``vllm_async_server`` imports ``verl.third_party.vllm``,
    which raises without a vLLM build verl supports: where this CPU run stops (on a GPU
    machine with vLLM the call returns ``vLLMPDReplica``)."""
    import importlib.util

    from verl.workers.rollout import llm_server, replica

    assert llm_server.get_rollout_replica_class is replica.get_rollout_replica_class
    has_vllm = importlib.util.find_spec("vllm") is not None
    for configured in (True, False):
        if configured:
            monkeypatch.setenv("ROUTER_REPLAY_CACHE", "route-cache:50051")
        else:
            monkeypatch.delenv("ROUTER_REPLAY_CACHE", raising=False)
        caplog.clear()
        with caplog.at_level("ERROR", logger="verl_integration.plugin"):
            if has_vllm:
                found = llm_server.get_rollout_replica_class("vllm", disaggregation_enabled=True)
                assert found.__name__ == "vLLMPDReplica"
            else:
                with pytest.raises(ValueError, match="vllm version None not supported"):
                    llm_server.get_rollout_replica_class("vllm", disaggregation_enabled=True)
        said = "PD replica without the route cache" in caplog.text
        assert said == configured, caplog.text


# --- policy versions against the sample's (issue 45) ---------------------------------------


def test_a_record_of_another_policy_version_is_refused_naming_the_sample(
    tiny_model_dir, route_cache
):
    """Two samples with identical histories, generated by policy versions 0 and 1, swapped
    under each other's id: the tokens match, so only the versions tell. verl's V1 batch
    (``list_of_dict_to_tensordict``) reports each sample's versions in its ``extra_fields``
    (``global_steps`` of the first call; ``min_global_steps`` / ``max_global_steps`` from
    ``FullyAsyncLLMServerClient``); ``attach_routes`` refuses the swapped record."""
    from verl.utils import tensordict_utils as tu

    from tests.verl.helpers import nested
    from trainer.data.source import CacheSource
    from verl_integration.engine import attach_routes
    from verl_integration.fetch import RouteFetcher

    geometry = served_geometry(str(tiny_model_dir))
    (record,) = rollout_records(tiny_model_dir, [[5, 6, 7, 8]], group_size=1, new_tokens=3)
    with RouteCacheClient(route_cache) as client:
        writer = TurnWriter(client, geometry)
        for version in (0, 1):
            output = token_output(record, 4, policy_version=version)
            writer.write(f"swap-v{version}", record.token_ids[:4].tolist(), output)
    tokens = torch.from_numpy(record.token_ids.astype(np.int64))

    def batch(ids_and_versions):  # as engine_batch, with each sample's versions
        from tensordict.tensorclass import NonTensorData, NonTensorStack

        n = len(ids_and_versions)
        extra = [NonTensorData({ID_FIELD: s, **v}) for s, v in ids_and_versions]
        return tu.get_tensordict(
            {
                "input_ids": nested([tokens] * n),
                "loss_mask": nested([torch.ones(3, dtype=torch.int64)] * n),
                "extra_fields": NonTensorStack.from_list(extra),
            }
        )

    fetcher = RouteFetcher(CacheSource(route_cache), geometry)
    rows = [("swap-v0", {"global_steps": 0}), ("swap-v1", {"global_steps": 1})]
    assert attach_routes(batch(rows), fetcher).replayed == 2
    ranged = [("swap-v1", {"global_steps": 1, "min_global_steps": 1, "max_global_steps": 2})]
    assert attach_routes(batch(ranged), fetcher).replayed == 1
    swapped = [("swap-v1", {"global_steps": 0}), ("swap-v0", {"global_steps": 1})]
    with pytest.raises(InvalidArgument, match="swap-v1.*versions \\[1\\].*version 0"):
        attach_routes(batch(swapped), fetcher)
    out_of_range = [("swap-v0", {"min_global_steps": 1, "max_global_steps": 2})]
    with pytest.raises(InvalidArgument, match="swap-v0.*versions \\[0\\].*versions 1-2"):
        attach_routes(batch(out_of_range), fetcher)
