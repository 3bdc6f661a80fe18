"""Every turn of a sample lands in the one record the trainer fetches, under verl's real flow.

Driven through verl's own classes: its agent-loop workers, V0's ``AgentLoopWorker``
(``generate_sequences``: a ``DataProto`` in, the trainer's ``DataProto`` out) and V1's
``AgentLoopWorkerTQ`` (fire-and-forget sessions whose outputs go into a real TransferQueue, read
back with ``kv_batch_get`` as verl's V1 trainer does), each running ``ToolAgentLoop`` (three
assistant turns, verl's function tool loaded from ``rollout.multi_turn.function_tool_path``,
its hermes tool parser and Continuous Token builder) over ``LLMServerClient`` (a fresh request
id on every call) and verl's ``GlobalRequestLoadBalancer``; resumes of aborted partial rollouts
through ``FullyAsyncLLMServerClient``. All over real Ray actors, with the plugin's changes to
verl's clients loaded the way verl loads them (its ``verl.plugins`` entry point, on
``import verl``). The trainer side reads the ids from the batch verl built
(``engine.sample_ids``) and fetches the routes (``RouteFetcher``), which must equal, row by
row, the routes each turn's own policy chose. The server is ``RouteCacheGenerate`` in front of
a stand-in for verl's vLLM server (``tests/verl/agent_server.py`` says exactly what it
reproduces and what stands in), writing to a real route cache over a real redis-server. Each
call is served by the next policy version (three tiny models, three seeds), so each turn's
routes differ from the next policy's.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from routereplay.dev.ray_local import start_local_ray
from routereplay.dev.tiny_model import build_tiny_model
from routereplay.rpc.client import RouteCacheClient
from tests.verl.agent_server import StandInServer
from tests.verl.cpu import needs_verl
from verl_integration.contract import ID_FIELD, served_geometry
from verl_integration.rollout import RouteCacheGenerate, sample_of

needs_verl()

# Qwen's ChatML markers, so verl picks its Qwen Continuous Token builder for the tiny Qwen3-MoE.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_MARKERS = ["<|im_start|>", "<|im_end|>"]


def chat_tokenizer(markers=CHAT_MARKERS, template=CHAT_TEMPLATE):
    """The tiny model's byte-level BPE, trained with a chat template's markers (ChatML's by
    default) as special tokens (ids below the tiny vocabulary, so the tiny model takes them as
    they are)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from routereplay.dev import tiny_model

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [tiny_model.EOS_TOKEN, tiny_model.PAD_TOKEN, *markers]
    trainer = trainers.BpeTrainer(
        vocab_size=tiny_model.VOCAB_SIZE,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_model._CORPUS.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=tiny_model.EOS_TOKEN,
        pad_token=tiny_model.PAD_TOKEN,
        additional_special_tokens=list(markers),
        chat_template=template,
    )


class Server(RouteCacheGenerate, StandInServer):
    pass


class PerCallServer(Server):
    """The mutation: records keyed by the server's per-call request id (what the integration did
    before it carried the sample id)."""

    def sample_id_of(self, request_id):
        return request_id


@pytest.fixture(scope="module")
def ray_local():
    ray = start_local_ray(
        num_cpus=8,  # logical: TransferQueue's controller and storage actors take one each
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "OMP_NUM_THREADS": "1"}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    """Three policies, a tokenizer with a chat template, verl's trainer config, the completions."""
    import verl
    from omegaconf import OmegaConf

    root = tmp_path_factory.mktemp("agent")
    policies = [str(root / "policy0")] + [
        str(build_tiny_model(root / f"policy{v}", seed=v)) for v in (1, 2)
    ]
    tokenizer = chat_tokenizer()
    model_dir = root / "policy0"  # the tiny model with the chat tokenizer
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer.save_pretrained(model_dir)
    tokenizer.save_pretrained(root / "tokenizer")
    config = OmegaConf.load(
        f"{verl.__path__[0]}/trainer/config/_generated_ppo_megatron_trainer.yaml"
    )
    rollout = config.actor_rollout_ref.rollout
    rollout.name = "vllm"
    rollout.enable_rollout_routing_replay = True
    rollout.multi_turn.enable = True
    rollout.multi_turn.max_assistant_turns = 3
    rollout.prompt_length = 256
    rollout.response_length = 512
    rollout.calculate_log_probs = True
    rollout.agent.default_agent_loop = "tool_agent"
    rollout.multi_turn.function_tool_path = str(Path(__file__).with_name("agent_tools.py"))
    config.actor_rollout_ref.model.path = str(model_dir)

    def call(a, b):
        text = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
        return tokenizer.encode(f"<tool_call>{text}</tool_call><|im_end|>")

    completions = [call(1, 2), call(3, 4), tokenizer.encode("It is 7.<|im_end|>")]
    return SimpleNamespace(
        policies=policies,
        tokenizer=tokenizer,
        tokenizer_dir=str(root / "tokenizer"),
        config=config,
        completions=completions,
        assistant="<|im_start|>assistant",
    )


def _server(ray, setup, route_cache, server_cls=Server):
    server_config = SimpleNamespace(
        enable_rollout_routing_replay=True, custom={"route_cache": route_cache}
    )
    return ray.remote(server_cls).remote(
        server_config, setup.policies, setup.completions, setup.tokenizer_dir, setup.assistant
    )


def _client(ray, setup, server, client_cls=None):
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    balancer = ray.remote(GlobalRequestLoadBalancer).remote(servers={"replica-0": server})
    return (client_cls or LLMServerClient)(setup.config, load_balancer_handle=balancer)


MESSAGES = [{"role": "user", "content": "1+2, then 3+4?"}]


def _run_v0(setup, client, validate=False):
    """verl's V0 agent-loop worker: one prompt; returns the trainer's batch (``DataProto``)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto

    batch = DataProto.from_dict(
        non_tensors={"raw_prompt": np.array([MESSAGES], dtype=object), "index": np.array([0])},
        meta_info={"validate": validate},
    )

    async def run():
        return await AgentLoopWorker(setup.config, client).generate_sequences(batch)

    return asyncio.run(run())


def _run_v1(setup, client, validate=False, uid=None):
    """verl's V1 agent-loop worker (TransferQueue): one prompt (``uid``, verl's prompt key);
    returns what verl's V1 trainer reads back from TransferQueue for the sample (a
    ``TensorDict``)."""
    import torch
    import transfer_queue as tq
    from tensordict import NonTensorData, NonTensorStack, TensorDict
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    worker_cls = AgentLoopWorkerTQ.__ray_metadata__.modified_class  # the class under @ray.remote
    partition = "val" if validate else "train"
    uid = uid or ("prompt-val-0" if validate else "prompt-0")
    fields = {
        "raw_prompt": NonTensorStack(MESSAGES),
        "index": torch.tensor([0]),
        "uid": NonTensorStack(uid),
        "global_steps": NonTensorData(1),
    }
    if validate:
        fields["validate"] = NonTensorData(True)
    batch = TensorDict(fields, batch_size=[1])

    async def run():
        worker = worker_cls(setup.config, client)  # initialises TransferQueue's client
        # The prompt (its GRPO group) registered as verl's V1 trainer does before generating.
        tags = [{"is_prompt": True, "status": "pending", "global_steps": 1}]
        tq.kv_batch_put(keys=[uid], partition_id=partition, tags=tags)
        await worker.generate_sequences(batch)
        await asyncio.gather(*worker.background_tasks)
        listed = tq.kv_list(partition_id=partition)[partition]
        assert listed[uid]["status"] == "finished", listed
        return tq.kv_batch_get(keys=[f"{uid}_0_0"], partition_id=partition)

    return asyncio.run(run())


def _sequence(batch) -> list[int]:
    """The sample's tokens as the trainer gets them: prompt and response without padding."""
    import torch

    if hasattr(batch, "non_tensor_batch"):  # V0: padded, with its attention mask
        return batch.batch["input_ids"][0][batch.batch["attention_mask"][0].bool()].tolist()
    ids = batch["input_ids"]
    return (ids.values() if ids.is_nested else torch.as_tensor(ids[0])).tolist()


def _trained_routes(batch, route_cache, geometry) -> tuple[str, np.ndarray]:
    """The trainer side: the sample id from verl's batch, its routes fetched (MoE columns)."""
    import torch
    from verl.protocol import DataProto

    from trainer.data.source import CacheSource
    from verl_integration.engine import sample_ids
    from verl_integration.fetch import RouteFetcher

    data = batch.to_tensordict() if isinstance(batch, DataProto) else batch
    (sample,) = sample_ids(data)
    tokens = torch.tensor([_sequence(batch)])
    routes = RouteFetcher(CacheSource(route_cache), geometry).routes(
        [sample], tokens, torch.ones_like(tokens)
    )
    rows = routes.routed[0].sum().item()
    return sample, routes.routed_experts[0, :rows][:, list(geometry.record.moe_layers)].numpy()


def _expected_rows(calls, geometry):
    """Each row's routes as generated: row i from the first call that ran token i as input,
    since the last call whose prompt rewrote the history at or before token i (row i depends
    on tokens 0..i only)."""
    moe = list(geometry.moe_layers)
    rows, history = [], []
    for _, prompt, completion, _, routes in calls:
        common = min(len(history), len(prompt))
        differ = [i for i in range(common) if history[i] != prompt[i]]
        del rows[differ[0] if differ else common :]
        rows.extend(routes[len(rows) : len(prompt) + len(completion) - 1][:, moe])
        history = [*prompt, *completion]
    return np.stack(rows)


def _check_record(record, tokens, calls, geometry):
    assert record.token_ids.tolist() == tokens[: record.num_tokens]
    assert record.num_tokens == len(calls[-1][1]) + len(calls[-1][2])
    assert [t.policy_version for t in record.turns] == [c[3] for c in calls]
    expected = _expected_rows(calls, geometry)
    np.testing.assert_array_equal(record.routes, expected)
    # What verl itself keeps, the last call's tensor, holds the last policy's rows for the
    # earlier turns: different routes.
    last = calls[-1][4][: len(expected), list(geometry.moe_layers)]
    assert not np.array_equal(last, expected)


@pytest.fixture(scope="module")
def agent_runs(ray_local, setup, route_cache):
    """The three-turn tool sample through verl's V0 and V1 agent-loop workers, each over its own
    server: ``{path: (the trainer's batch, the server's calls)}``, run on first use."""
    runs = {}

    def run(path):
        if path not in runs:
            server = _server(ray_local, setup, route_cache)
            runner = _run_v0 if path == "V0" else _run_v1
            batch = runner(setup, _client(ray_local, setup, server))
            runs[path] = batch, ray_local.get(server.calls.remote())
        return runs[path]

    return run


@pytest.mark.parametrize("path", ["V0", "V1"])
def test_three_tool_turns_land_in_the_record_the_trainer_fetches(
    agent_runs, setup, route_cache, path
):
    geometry = served_geometry(setup.policies[0])
    batch, calls = agent_runs(path)
    assert len(calls) == 3  # three assistant turns, the tool's answers between them
    # verl sent a fresh request id every call; each carried the agent loop's one sample id,
    # which the trainer's batch holds (the first call's extra_fields, as verl keeps them).
    request_ids = [c[0] for c in calls]
    assert len(set(request_ids)) == 3
    sample, trained = _trained_routes(batch, route_cache, geometry)
    assert {sample_of(r) for r in request_ids} == {sample}
    with RouteCacheClient(route_cache) as client:
        record = client.read(sample)
    _check_record(record, _sequence(batch), calls, geometry.record)
    np.testing.assert_array_equal(trained, _expected_rows(calls, geometry.record))


@pytest.mark.slow
def test_the_agent_loops_sample_is_replayed_by_verls_engine_under_pp2(
    agent_runs, setup, route_cache, tmp_path
):
    """The V1 run's sample, from its record in the route cache, trained by verl's engine path
    (``RouteCacheEngine``: verl's ``forward_backward_batch`` and ``forward_step``, megatron's
    PP2 schedule on two gloo ranks; tests/verl/test_engine.py says what stands in there): every
    router of both stages replays, on every row, the experts the policy that generated that
    row's token chose; the oracle is the server's own calls, not the route cache."""
    from routereplay.domain.record import Record, Turn
    from routereplay.domain.record_file import save_records
    from tests.verl.helpers import torchrun

    geometry = served_geometry(setup.policies[0]).record
    batch, calls = agent_runs("V1")
    sample, _ = _trained_routes(batch, route_cache, served_geometry(setup.policies[0]))
    tokens = np.asarray(_sequence(batch), dtype=np.int32)
    expected = _expected_rows(calls, geometry).astype(geometry.dtype)
    oracle = Record(sample, geometry, tokens, expected, [Turn(0, tokens.size, 0)])
    path = save_records(tmp_path / "oracle.npz", [oracle])
    out = tmp_path / "engine"
    proc = torchrun("engine_pp2_v1", setup.policies[0], path, route_cache, out, [[]])
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    assert proc.returncode == 0, (ranks, proc.stderr[-6000:])
    for r in ranks:
        assert r["engine_class"] == "RouteCacheEngine" and not r["bad"], r["bad"]
    # Rank 0 holds MoE layer 1, rank 1 layers 2 and 3: every row replayed on each.
    assert [r["replayed"] for r in ranks] == [oracle.num_rows, 2 * oracle.num_rows]


def test_keyed_by_the_per_call_request_id_the_turns_are_lost(
    ray_local, setup, route_cache, tiny_model_dir
):
    """The mutation the id carrying guards against: the trainer's id names turn 1's record."""
    geometry = served_geometry(setup.policies[0])
    server = _server(ray_local, setup, route_cache, PerCallServer)
    batch = _run_v0(setup, _client(ray_local, setup, server))
    calls = ray_local.get(server.calls.remote())
    sample, trained = _trained_routes(batch, route_cache, geometry)
    with RouteCacheClient(route_cache) as client:
        record = client.read(sample)
    with pytest.raises(AssertionError):
        _check_record(record, _sequence(batch), calls, geometry.record)
    assert record.num_tokens == len(calls[0][1]) + len(calls[0][2])  # turn 1 alone
    assert len(trained) < len(_expected_rows(calls, geometry.record))


def test_a_partial_rollout_resumed_after_an_abort_keeps_both_versions(
    ray_local, setup, route_cache, tiny_model_dir
):
    """verl's FullyAsyncLLMServerClient: the first call is aborted after 5 tokens (its routes
    kept), the resume is served by the next policy; the rebuilt output keeps the sample's id."""
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    server = _server(ray_local, setup, route_cache)
    client = _client(ray_local, setup, server, FullyAsyncLLMServerClient)
    ray_local.get(server.abort_next.remote(5))
    prompt = setup.tokenizer.encode("<|im_start|>user\nadd<|im_end|>\n<|im_start|>assistant\n")
    output = asyncio.run(
        client.generate("sample-resumed", prompt_ids=prompt, sampling_params={"logprobs": True})
    )
    calls = ray_local.get(server.calls.remote())
    assert [len(c[2]) for c in calls] == [5, len(setup.completions[0]) - 5]
    assert output.token_ids == setup.completions[0]
    assert output.extra_fields[ID_FIELD] == "sample-resumed"
    with RouteCacheClient(route_cache) as rc:
        record = rc.read("sample-resumed")
    assert record.token_ids.tolist() == prompt + setup.completions[0]
    assert [t.policy_version for t in record.turns] == [0, 1]
    np.testing.assert_array_equal(
        record.routes, _expected_rows(calls, served_geometry(setup.policies[0]).record)
    )


@pytest.mark.parametrize("client", ["LLMServerClient", "FullyAsyncLLMServerClient"])
def test_an_aborted_empty_first_call_still_carries_the_id(ray_local, setup, route_cache, client):
    """A request aborted before its first token (verl's answer on pause, drain and every
    non-naive weight sync), under verl's plain client and under ``FullyAsyncLLMServerClient``
    with ``partial_rollout=False`` (it returns the abort instead of resuming): nothing is stored,
    the output is verl's, and it carries the sample's id, which verl's agent loop keeps from the
    first call (the trainer then tells the sample from one generated without the integration,
    and skips it: its loss mask is empty)."""
    from omegaconf import OmegaConf
    from verl.workers.rollout import llm_server

    config = setup.config
    if client == "FullyAsyncLLMServerClient":
        config = OmegaConf.create(OmegaConf.to_container(setup.config))
        config.async_training = {"partial_rollout": False}
    server = _server(ray_local, setup, route_cache)
    balancer_setup = SimpleNamespace(**{**vars(setup), "config": config})
    client_obj = _client(ray_local, balancer_setup, server, getattr(llm_server, client))
    ray_local.get(server.abort_next.remote(0))
    sample = f"sample-aborted-{client}"
    prompt = setup.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    output = asyncio.run(client_obj.generate(sample, prompt_ids=prompt, sampling_params={}))
    assert output.token_ids == [] and output.routed_experts is None
    assert output.stop_reason == "aborted" and output.extra_fields[ID_FIELD] == sample
    assert len(ray_local.get(server.calls.remote())) == 1  # not resumed
    with RouteCacheClient(route_cache) as rc:
        with pytest.raises(Exception, match=sample):
            rc.stat(sample)


# --- verl's batch padding (V1's _balance_batch) ----------------------------------------------


def _padded_by_verl(agent_runs, setup, multiple=3):
    """The V1 run's sample as verl's V1 trainer balances it: ``upsample_batch_to_divisible_size``
    (what ``_balance_batch`` calls when the batch is not divisible by ``lcm(dp_size,
    ppo_mini_batch_size x n)``) appends ``multiple - 1`` copies of sample 0 in TransferQueue:
    EOS tokens, a zero loss mask, and sample 0's ``extra_fields`` (its route cache id). Returns
    the sample's id and what the trainer workers get back (``kv_batch_get``)."""
    import transfer_queue as tq
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size

    from verl_integration.engine import row_ids

    batch, _ = agent_runs("V1")
    (sample,) = row_ids(batch)
    key = "prompt-0_0_0"
    tags = tq.kv_list(partition_id="train")["train"][key]
    meta = KVBatchMeta(keys=[key], tags=[tags], partition_id="train")
    meta = upsample_batch_to_divisible_size(meta, multiple, setup.tokenizer.eos_token_id)
    assert len(meta) == multiple and [t.get("is_padding", False) for t in meta.tags] == [
        False,
        *[True] * (multiple - 1),
    ]
    return sample, tq.kv_batch_get(keys=meta.keys, partition_id="train")


def test_verls_padding_rows_are_neither_fetched_nor_checked(agent_runs, setup, route_cache):
    """The padding rows carry sample 0's id with other tokens: fetched and checked they would
    fail the step (``InvalidArgument``: the tokens differ at position 0). Their loss mask is
    empty, so they train nothing: the engine fetches only the real row, routes the padding
    natively and counts it in the step's report."""
    from trainer.data.source import CacheSource
    from verl_integration.engine import ROUTED_FIELD, RouteReport, attach_routes, row_ids
    from verl_integration.fetch import RouteFetcher

    geometry = served_geometry(setup.policies[0])
    sample, data = _padded_by_verl(agent_runs, setup)
    assert row_ids(data) == [sample] * 3  # the deep copy of sample 0's extra_fields
    fetcher = RouteFetcher(CacheSource(route_cache), geometry)
    with pytest.raises(Exception, match=f"{sample}.*differ.*position 0"):
        fetcher.routes(row_ids(data), data["input_ids"])  # what the engine did before

    report = attach_routes(data, fetcher)
    assert report == RouteReport(replayed=1, untrained=2, no_id=0, missing=0, diverged_rows=0)
    with RouteCacheClient(route_cache) as client:
        rows = client.stat(sample).num_tokens - 1
    routed = [r.tolist() for r in data[ROUTED_FIELD].unbind()]
    assert routed[0] == [True] * rows + [False] * (len(routed[0]) - rows)
    assert routed[1] == routed[2] == [False] * 128  # verl's SYNTHETIC_PADDING_SEQ_LEN
    assert not any(t.any() for t in data["routed_experts"].unbind()[1:])


@pytest.mark.slow
def test_verls_padded_batch_replays_real_rows_under_pp2(agent_runs, setup, route_cache, tmp_path):
    """The batch verl's ``upsample_batch_to_divisible_size`` padded, through verl's
    ``forward_backward_batch`` and ``forward_step`` in ``RouteCacheEngine`` (PP2 on megatron's
    schedule, two gloo ranks; tests/verl/test_engine.py says what stands in): every router of
    both stages replays the real sample's rows with the experts of the policy that generated
    each token, and chooses natively on every row of the two padding samples; verl's step
    metrics carry the report."""
    import torch

    from routereplay.domain.record import Record, Turn
    from routereplay.domain.record_file import save_records
    from tests.verl.helpers import torchrun

    geometry = served_geometry(setup.policies[0]).record
    sample, data = _padded_by_verl(agent_runs, setup)
    _, calls = agent_runs("V1")
    tokens = np.asarray(data["input_ids"].unbind()[0].tolist(), dtype=np.int32)
    expected = _expected_rows(calls, geometry).astype(geometry.dtype)
    oracle = Record(sample, geometry, tokens, expected, [Turn(0, tokens.size, 0)])
    records = save_records(tmp_path / "oracle.npz", [oracle])
    torch.save(data, tmp_path / "batch.pt")  # what verl's trainer hands the workers
    out = tmp_path / "engine"
    batch = tmp_path / "batch.pt"
    proc = torchrun("engine_pp2_batch", setup.policies[0], records, route_cache, out, [[]], batch)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    assert proc.returncode == 0, (ranks, proc.stderr[-6000:])
    for r in ranks:
        assert r["engine_class"] == "RouteCacheEngine" and not r["bad"], r["bad"]
        assert r["untrained_rows"] == 2
        assert r["report"] == dict(replayed=1, untrained=2, no_id=0, missing=0, diverged_rows=0), r[
            "report"
        ]
    # Rank 0 holds MoE layer 1, rank 1 layers 2 and 3; the padding's 2 x 128 rows natively,
    # with the real sample's last row.
    assert [r["replayed"] for r in ranks] == [oracle.num_rows, 2 * oracle.num_rows]
    assert [r["natural"] for r in ranks] == [257, 2 * 257]
    assert "route_cache/untrained" in ranks[1]["metrics"]


def test_groups_verl_drops_untrained_are_freed(ray_local, setup, route_cache, monkeypatch):
    """verl's V1 replay buffer (``ReplayBufferAsync``, ``max_off_policy_strategy="drop"``)
    evicts a finished group that grew stale: it never trains, and its samples' records are
    deleted from the route cache as verl clears it from TransferQueue (``_clear_groups``).
    With verl's own ``_clear_groups`` (the plugin's hook undone) the record stays: run once."""
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import replay_buffer

    from verl_integration.engine import row_ids

    monkeypatch.setenv("ROUTER_REPLAY_CACHE", route_cache)
    server = _server(ray_local, setup, route_cache)
    (sample,) = row_ids(_run_v1(setup, _client(ray_local, setup, server), uid="prompt-stale"))
    with RouteCacheClient(route_cache) as client:
        assert client.stat(sample).num_tokens > 0
        refills = []
        buffer = replay_buffer.ReplayBufferAsync(
            trainer_mode="async",
            trainer_config=OmegaConf.create({}),
            max_off_policy_threshold=1,
            max_off_policy_strategy="drop",
            sampler_kwargs=OmegaConf.create({}),
            refill_fn=refills.append,
        )
        # Generated at step 1, sampled at step 3: two versions behind, beyond the threshold.
        buffer.wait_for_sampleable(global_steps=3, partition_id="train", target_count=0)
        # verl evicted the group (and any other of this module's, all made at step 1) and
        # asked for replacements.
        assert sum(refills) >= 1
        assert "prompt-stale" not in tq.kv_list(partition_id="train")["train"]
        with pytest.raises(Exception, match=sample):
            client.stat(sample)


@pytest.mark.parametrize("path", ["V0", "V1"])
def test_validation_rollouts_store_nothing(ray_local, setup, route_cache, path):
    """verl runs validation batches (V0 ``meta_info["validate"]``, V1 ``batch["validate"]``)
    through the same agent-loop workers, clients and servers as training ones, and never trains
    them: the plugin marks the worker's validation batches, every call's request id says so,
    and the server stores nothing (a record would only wait out the route cache's TTL). The
    batch still carries the sample's id; the calls ran as in training."""
    from verl_integration.engine import row_ids
    from verl_integration.rollout import VALIDATION_TAG, validation_sample_of

    server = _server(ray_local, setup, route_cache)
    client = _client(ray_local, setup, server)
    batch = (_run_v0 if path == "V0" else _run_v1)(setup, client, validate=True)
    calls = ray_local.get(server.calls.remote())
    assert len(calls) == 3 and all(c[0].startswith(VALIDATION_TAG) for c in calls)
    data = batch.to_tensordict() if path == "V0" else batch
    (sample,) = row_ids(data)
    assert {validation_sample_of(c[0]) for c in calls} == {sample}
    with RouteCacheClient(route_cache) as rc:
        with pytest.raises(Exception, match=sample):
            rc.stat(sample)


# --- histories rewritten mid-batch (verl's GLM token builder; an earlier edit) ---------------


@pytest.fixture(scope="module")
def glm_setup(setup, tmp_path_factory):
    """GLM-4.5 policies (tiny, three seeds) and GLM's chat markers, so that verl's agent loop
    picks its GLM Continuous Token builder (by the model's ``model_type``); each assistant turn
    stops on ``<|user|>``, which the builder drops when it merges the tool's answer."""
    from tests.verl.test_dropin import GLM_MARKERS, GLM_TEMPLATE

    root = tmp_path_factory.mktemp("glm")
    policies = [
        str(build_tiny_model(root / f"policy{v}", seed=v, family="glm4_moe")) for v in range(3)
    ]
    tokenizer = chat_tokenizer(GLM_MARKERS, GLM_TEMPLATE)
    tokenizer.save_pretrained(policies[0])
    tokenizer.save_pretrained(root / "tokenizer")
    config = setup.config.copy()
    config.actor_rollout_ref.model.path = policies[0]
    user = tokenizer.convert_tokens_to_ids("<|user|>")

    def call(a, b):
        text = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
        return [*tokenizer.encode(f"<tool_call>{text}</tool_call>"), user]

    return SimpleNamespace(
        policies=policies,
        tokenizer=tokenizer,
        tokenizer_dir=str(root / "tokenizer"),
        config=config,
        completions=[call(1, 2), call(3, 4), [*tokenizer.encode("It is 7."), user]],
        assistant="<|assistant|>",
        user=user,
    )


def test_rewritten_histories_cost_no_sample_of_the_batch(ray_local, glm_setup, route_cache):
    """verl's V0 ``AgentLoopWorker`` (what ``AgentLoopManager`` runs in each worker) on a batch
    of three GLM samples: every turn's prompt rewrites the record's last token (the GLM
    builder's ``<|user|>`` junction), and one sample's loop (``RewritingToolAgentLoop``) also
    edits a token of its initial prompt after the first tool answer. Every sample trains: the
    trainer fetches each one's record against the history verl kept and replays every row, each
    from the call that last ran it; the edited sample's rows from the edit on come from the call
    that ran the edited history. Before issue 45 the first junction raised in ``generate()``
    and V0's gather failed the whole batch."""
    import torch
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto

    from tests.verl.agent_loops import REWRITING_AGENT, edited_position
    from trainer.data.source import CacheSource
    from verl_integration.engine import sample_ids
    from verl_integration.fetch import RouteFetcher

    setup = glm_setup
    geometry = served_geometry(setup.policies[0])
    server = _server(ray_local, setup, route_cache)
    agents = ["tool_agent", REWRITING_AGENT, "tool_agent"]
    batch = DataProto.from_dict(
        non_tensors={
            "raw_prompt": np.array([MESSAGES] * 3, dtype=object),
            "index": np.arange(3),
            "agent_name": np.array(agents, dtype=object),
        },
        meta_info={"validate": False},
    )

    async def run():
        return await AgentLoopWorker(
            setup.config, _client(ray_local, setup, server)
        ).generate_sequences(batch)

    out = asyncio.run(run())
    calls = ray_local.get(server.calls.remote())
    data = out.to_tensordict()
    samples = sample_ids(data)
    assert len(set(samples)) == 3 and len(calls) == 9

    fetcher = RouteFetcher(CacheSource(route_cache), geometry)
    for row, (sample, agent) in enumerate(zip(samples, agents, strict=True)):
        own = [c for c in calls if sample_of(c[0]) == sample]
        mask = out.batch["attention_mask"][row].bool()
        history = out.batch["input_ids"][row][mask].tolist()
        expected = _expected_rows(own, geometry.record)
        # verl's builder dropped the <|user|> each assistant turn stopped on.
        assert own[1][1][len(own[0][1]) + len(own[0][2]) - 1] != setup.user
        if agent == REWRITING_AGENT:
            at = edited_position(own[1][1], len(own[1][1]) - len(own[0][1]))
            assert own[1][1][:at] == own[0][1][:at] and own[1][1][at] != own[0][1][at]
            np.testing.assert_array_equal(
                expected[:at], own[0][4][:at][:, list(geometry.record.moe_layers)]
            )
        with RouteCacheClient(route_cache) as client:
            record = client.read(sample)
        assert record.token_ids.tolist() == history[: record.num_tokens]
        np.testing.assert_array_equal(record.routes, expected)
        tokens = torch.tensor([history])
        routes = fetcher.routes([sample], tokens, torch.ones_like(tokens))
        rows = int(routes.routed[0].sum())
        assert rows == record.num_rows and routes.diverged.tolist() == [0]
        trained = routes.routed_experts[0, :rows][:, list(geometry.record.moe_layers)].numpy()
        np.testing.assert_array_equal(trained, expected)
