"""Every turn of a sample lands in the one record the trainer fetches, under verl's real flow.

Driven through verl's own classes: ``ToolAgentLoop`` (three assistant turns, a real tool in
between, verl's hermes tool parser and Continuous Token builder), ``LLMServerClient`` and
``FullyAsyncLLMServerClient`` (a fresh request id on every call, resumes of aborted partial
rollouts), verl's ``GlobalRequestLoadBalancer``, all over real Ray actors, with the plugin's
changes to verl's clients loaded the way verl loads them (its ``verl.plugins`` entry point, on
``import verl``). The server is ``RouteCacheGenerate`` in front of a stand-in for verl's vLLM
server (``tests/verl/agent_server.py`` says exactly what it reproduces and what stands in),
writing to a real route cache over a real redis-server. Each call is served by the next policy
version (three tiny models, three seeds), so each turn's routes differ from the next policy's.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

from routereplay.dev.tiny_model import build_tiny_model
from routereplay.rpc.client import RouteCacheClient
from tests.verl.agent_server import StandInServer
from tests.verl.cpu import needs_verl
from verl_integration.rollout import ID_FIELD, RouteCacheGenerate, sample_of

needs_verl()

# ChatML-like, closing each message with the tokenizer's EOS (its only stop token).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
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
    import ray

    ray.init(
        num_cpus=2,
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
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("agent")
    policies = [str(tiny_model_dir)] + [
        str(build_tiny_model(root / f"policy{v}", seed=v)) for v in (1, 2)
    ]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
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

    def call(a, b):
        text = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
        return tokenizer.encode(f"<tool_call>{text}</tool_call>") + [tokenizer.eos_token_id]

    completions = [call(1, 2), call(3, 4), tokenizer.encode("It is 7.") + [tokenizer.eos_token_id]]
    return SimpleNamespace(
        policies=policies,
        tokenizer=tokenizer,
        tokenizer_dir=str(root / "tokenizer"),
        config=config,
        completions=completions,
    )


def _server(ray, setup, route_cache, server_cls=Server):
    server_config = SimpleNamespace(
        enable_rollout_routing_replay=True, custom={"route_cache": route_cache}
    )
    return ray.remote(server_cls).remote(
        server_config, setup.policies, setup.completions, setup.tokenizer_dir
    )


def _client(ray, setup, server, client_cls=None):
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    balancer = ray.remote(GlobalRequestLoadBalancer).remote(servers={"replica-0": server})
    return (client_cls or LLMServerClient)(setup.config, load_balancer_handle=balancer)


class AddTool:
    """A real verl tool (``BaseTool``): adds two integers."""

    @staticmethod
    def build():
        from verl.tools.base_tool import BaseTool
        from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

        class Add(BaseTool):
            async def execute(self, instance_id, parameters, **kwargs):
                return ToolResponse(text=str(int(parameters["a"]) + int(parameters["b"]))), 0.0, {}

        schema = OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "description": "Add two integers.",
                    "parameters": {
                        "type": "object",
                        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"],
                    },
                },
            }
        )
        return Add({}, schema)


def _run_tool_agent(setup, client):
    """verl's ToolAgentLoop over ``client``: one sample, until it stops calling tools."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.utils.dataset.rl_dataset import RLHFDataset

    async def run():
        loop = ToolAgentLoop(
            trainer_config=DictConfigWrap(setup.config),
            server_manager=client,
            tokenizer=setup.tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(setup.config.data),
            tools=ToolListWrap([AddTool.build()]),
        )
        return await loop.run(
            {"temperature": 1.0, "logprobs": True},
            raw_prompt=[{"role": "user", "content": "1+2, then 3+4?"}],
        )

    return asyncio.run(run())


def _expected_rows(calls, geometry):
    """Each row's routes as generated: row i from the first call that ran token i as input."""
    moe = list(geometry.moe_layers)
    rows = []
    for _, prompt, completion, _, routes in calls:
        rows.extend(routes[len(rows) : len(prompt) + len(completion) - 1][:, moe])
    return np.stack(rows)


def _check_record(record, output, calls, geometry):
    tokens = list(output.prompt_ids) + list(output.response_ids)
    assert record.token_ids.tolist() == tokens[: record.num_tokens]
    assert record.num_tokens == len(calls[-1][1]) + len(calls[-1][2])
    assert [t.policy_version for t in record.turns] == [c[3] for c in calls]
    expected = _expected_rows(calls, geometry)
    np.testing.assert_array_equal(record.routes, expected)
    # What verl itself keeps, the last call's tensor, holds the last policy's rows for the
    # earlier turns: different routes.
    last = calls[-1][4][: len(expected), list(geometry.moe_layers)]
    assert not np.array_equal(last, expected)


def test_three_tool_turns_land_in_the_record_the_trainer_fetches(
    ray_local, setup, route_cache, tiny_model_dir
):
    from tests.verl.helpers import geometry_of

    server = _server(ray_local, setup, route_cache)
    output = _run_tool_agent(setup, _client(ray_local, setup, server))
    calls = ray_local.get(server.calls.remote())
    assert len(calls) == 3 and output.num_turns == 6  # user, 3 assistant, 2 tool
    # verl sent a fresh request id every call; each carried the agent loop's one sample id.
    request_ids = [c[0] for c in calls]
    assert len(set(request_ids)) == 3
    sample = output.extra_fields[ID_FIELD]  # the first call's extra_fields, as verl keeps them
    assert {sample_of(r) for r in request_ids} == {sample}
    # V1 (TransferQueue) keeps extra_fields as one dict per sample: the id is there.
    assert output.as_dict()["extra_fields"][ID_FIELD] == sample
    with RouteCacheClient(route_cache) as client:
        record = client.read(sample)
    _check_record(record, output, calls, geometry_of(tiny_model_dir).record)


def test_keyed_by_the_per_call_request_id_the_turns_are_lost(
    ray_local, setup, route_cache, tiny_model_dir
):
    """The mutation the id carrying guards against: the trainer's id names turn 1's record."""
    from tests.verl.helpers import geometry_of

    server = _server(ray_local, setup, route_cache, PerCallServer)
    output = _run_tool_agent(setup, _client(ray_local, setup, server))
    calls = ray_local.get(server.calls.remote())
    with RouteCacheClient(route_cache) as client:
        record = client.read(output.extra_fields[ID_FIELD])
    with pytest.raises(AssertionError):
        _check_record(record, output, calls, geometry_of(tiny_model_dir).record)
    assert record.num_tokens == len(calls[0][1]) + len(calls[0][2])  # turn 1 alone


def test_a_partial_rollout_resumed_after_an_abort_keeps_both_versions(
    ray_local, setup, route_cache, tiny_model_dir
):
    """verl's FullyAsyncLLMServerClient: the first call is aborted after 5 tokens (its routes
    kept), the resume is served by the next policy; the rebuilt output keeps the sample's id."""
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    from tests.verl.helpers import geometry_of

    server = _server(ray_local, setup, route_cache)
    client = _client(ray_local, setup, server, FullyAsyncLLMServerClient)
    ray_local.get(server.abort_next.remote(5))
    prompt = setup.tokenizer.encode("<|im_start|>user\nadd<|endoftext|>\n<|im_start|>assistant\n")
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
        record.routes, _expected_rows(calls, geometry_of(tiny_model_dir).record)
    )


def test_aborted_empty_outputs_pass_through_untouched(ray_local, setup, route_cache):
    server = _server(ray_local, setup, route_cache)
    client = _client(ray_local, setup, server)
    ray_local.get(server.abort_next.remote(0))
    prompt = setup.tokenizer.encode("<|im_start|>user\nhi<|endoftext|>\n<|im_start|>assistant\n")
    output = asyncio.run(client.generate("sample-aborted", prompt_ids=prompt, sampling_params={}))
    assert output.token_ids == [] and output.routed_experts is None
    assert output.stop_reason == "aborted" and ID_FIELD not in output.extra_fields
    with RouteCacheClient(route_cache) as rc:
        with pytest.raises(Exception, match="sample-aborted"):
            rc.stat("sample-aborted")
