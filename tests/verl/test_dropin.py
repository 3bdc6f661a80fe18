"""The rollout seam's drop-in for verl's server class, and its plugin registration.

verl's ``vLLMHttpServer`` needs a vLLM build verl supports (not installable next to verl on this
CPU machine), so the server under the mix-in here is a stand-in whose ``generate()`` returns
what verl's would: a ``TokenOutput`` from the transformers rollout, the weights' version in
``extra_fields["global_steps"]``. Everything from the mix-in on is the real thing: the asyncio
client, the route cache over a real redis-server.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from routereplay.dev.hf_rollout import rollout_records
from routereplay.rpc.client import AsyncRouteCacheClient, RouteCacheClient
from tests.verl.cpu import needs_verl
from tests.verl.helpers import geometry_of, token_output
from verl_integration.contract import ID_FIELD
from verl_integration.rollout import (
    RouteCacheGenerate,
    TurnWriter,
    route_cache_replica,
    tag_request_id,
)

needs_verl()


class StandInServer:
    """Answers each call with the next prepared ``TokenOutput`` (see the module docstring)."""

    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.calls = []

    async def generate(self, prompt_ids, sampling_params, request_id, **kwargs):
        self.calls.append((list(prompt_ids), request_id))
        return self.outputs.pop(0)


class Server(RouteCacheGenerate, StandInServer):
    pass


def test_generate_writes_each_call_as_a_turn_and_ships_ids(tiny_model_dir, route_cache):
    geometry = geometry_of(tiny_model_dir)
    first = rollout_records(tiny_model_dir, [[9, 8, 7, 6]], group_size=1, new_tokens=3)[0]
    history = first.token_ids.tolist() + [33, 44]
    second = rollout_records(tiny_model_dir, [history], group_size=1, new_tokens=3, seed=4)[0]
    server = Server(
        [
            token_output(first, 4, policy_version=5),
            token_output(second, len(history), policy_version=6),
        ]
    )

    async def run():
        server.route_writer = TurnWriter(AsyncRouteCacheClient(route_cache), geometry)
        # verl's client: a fresh request id per call, the sample's id carried inside.
        one = await server.generate([9, 8, 7, 6], {}, tag_request_id("req-dropin", "call-1"))
        two = await server.generate(history, {}, tag_request_id("req-dropin", "call-2"))
        await server.route_writer.client.close()
        return one, two

    one, two = asyncio.run(run())
    for out in (one, two):
        assert out.routed_experts is None and out.extra_fields[ID_FIELD] == "req-dropin"
    assert one.token_ids == first.token_ids[4:].tolist()
    with RouteCacheClient(route_cache) as client:
        stored = client.read("req-dropin")
    assert np.array_equal(stored.token_ids, second.token_ids)
    assert [(t.token_start, t.generated_start, t.policy_version) for t in stored.turns] == [
        (0, 4, 5),
        (7, 9, 6),
    ]
    # Turn 1's rows from the first call; the rest (from its last token on) from the second.
    assert np.array_equal(stored.routes[: first.num_rows], first.routes)
    assert np.array_equal(stored.routes[first.num_rows :], second.routes[first.num_rows :])


def test_a_request_without_a_sample_id_is_refused(tiny_model_dir, route_cache):
    """verl's own request ids (a fresh uuid, or ``det-0`` under full_determinism) name no
    sample: storing under them would split a sample across records."""
    from routereplay.errors import FailedPrecondition

    record = rollout_records(tiny_model_dir, [[9, 8, 7, 6]], group_size=1, new_tokens=3)[0]
    server = Server([token_output(record, 4)])
    server.route_writer = "unused"
    with pytest.raises(FailedPrecondition, match="carries no sample id"):
        asyncio.run(server.generate([9, 8, 7, 6], {}, "0f1e2d3c4b5a69788796a5b4c3d2e1f0"))
    assert server.calls == []  # refused before the engine ran


@pytest.mark.parametrize("where", ["last token", "earlier"])
def test_a_prompt_that_rewrites_the_history_rewrites_the_record(tiny_model_dir, route_cache, where):
    """Fault 8 and issue 45: the length of the stored history is not enough, and a rewrite
    must cost no batch. verl's GLM token builder replaces the record's last token at the
    assistant/tool junction ("last token"): every recorded row is kept (a record of T tokens
    holds T - 1 rows) and the token is replaced. An earlier difference starts a new segment
    from the common prefix: the rows before it are kept, the rest come from this call. Either
    way the trainer, fetching against the history as verl's agent loop kept it, replays every
    row (none diverged); with the digest this process kept, and with the tokens read back."""
    import torch

    from tests.verl.helpers import nested
    from trainer.data.source import CacheSource
    from verl_integration.fetch import RouteFetcher

    geometry = geometry_of(tiny_model_dir)
    first = rollout_records(tiny_model_dir, [[9, 8, 7, 6]], group_size=1, new_tokens=3)[0]
    edited = first.token_ids.tolist()
    at = first.num_tokens - 1 if where == "last token" else 5
    edited[at] = (edited[at] + 1) % 500 + 2  # the same length, one token rewritten
    second = rollout_records(tiny_model_dir, [edited + [33]], group_size=1, new_tokens=2)[0]
    with RouteCacheClient(route_cache) as client:
        for remembered in (4096, 0):  # the digest this process kept, and the read-back
            sample = f"verl-rewritten-{where.replace(' ', '-')}-{remembered}"
            writer = TurnWriter(client, geometry, remembered=remembered)
            writer.write(sample, [9, 8, 7, 6], token_output(first, 4, policy_version=1))
            writer.write(sample, edited + [33], token_output(second, len(edited) + 1, 2))
            stored = client.read(sample)
            assert np.array_equal(stored.token_ids, second.token_ids)
            assert np.array_equal(stored.routes[:at], first.routes[:at])
            assert np.array_equal(stored.routes[at:], second.routes[at:])
            assert [
                (t.token_start, t.token_end, t.generated_start, t.policy_version)
                for t in stored.turns
            ] == [(0, at, 4, 1), (at, second.num_tokens, len(edited) + 1, 2)]
            tokens = torch.from_numpy(second.token_ids.astype(np.int64))
            routes = RouteFetcher(CacheSource(route_cache), geometry).routes(
                [sample], nested([tokens])
            )
            assert routes.diverged.tolist() == [0]
            assert int(routes.routed.values().sum()) == stored.num_rows


GLM_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
GLM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|observation|>{% else %}"
    "<|{{ m['role'] }}|>{% endif %}\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_glms_user_junction_replaces_the_records_last_token(tiny_model_dir, route_cache, tmp_path):
    """verl's GLM Continuous Token builder (``GLMContinuousTokenBuilder``), merging a tool's
    answer after an assistant turn that stopped on ``<|user|>``, drops that token and appends
    ``<|observation|>...``: the next call's prompt differs from the record at its last token.
    The rollout seam replaces that token, keeps every recorded row (turn 1's policy) and appends
    the call's rows (turn 2's policy); the trainer, fetching against the history verl's builder
    made, replays every row. Before issue 45 this call raised and failed the batch."""
    import torch
    from verl.utils.tokenizer.continuous_token import GLMContinuousTokenBuilder

    from routereplay.dev.tiny_model import build_tiny_model
    from tests.verl.helpers import forced_record, nested
    from tests.verl.test_agent_loop import chat_tokenizer
    from trainer.data.source import CacheSource
    from verl_integration.fetch import RouteFetcher

    tokenizer = chat_tokenizer(GLM_MARKERS, GLM_TEMPLATE)
    builder = GLMContinuousTokenBuilder(tokenizer)
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    messages = [{"role": "user", "content": "add 1 and 2"}]
    prompt = builder.build_initial_tokens(messages)
    history = prompt + tokenizer.encode("calling add") + [user]  # stopped on <|user|>
    answered = [*messages, {"role": "assistant", "content": "calling add"}]
    merged = builder.merge_context_tokens(
        answered, [*answered, {"role": "tool", "content": "3"}], history
    )
    assert merged.removed_prefix_token_count == 1
    second = merged.token_ids
    junction = len(history) - 1  # the record's last token
    assert second[:junction] == history[:junction] and second[junction] != user

    geometry = geometry_of(tiny_model_dir)
    policy1 = build_tiny_model(tmp_path / "policy1", seed=1)
    one = forced_record(tiny_model_dir, history, len(prompt), policy_version=0)
    two = forced_record(policy1, second + tokenizer.encode("It is 3."), len(second), 1)
    sample = "verl-glm-junction"
    with RouteCacheClient(route_cache) as client:
        writer = TurnWriter(client, geometry)
        writer.write(sample, prompt, token_output(one, len(prompt), 0))
        writer.write(sample, second, token_output(two, len(second), 1))
        stored = client.read(sample)
    assert np.array_equal(stored.token_ids, two.token_ids)
    assert np.array_equal(stored.routes[:junction], one.routes)  # every recorded row kept
    assert np.array_equal(stored.routes[junction:], two.routes[junction:])
    assert not np.array_equal(stored.routes[:junction], two.routes[:junction])
    assert [t.policy_version for t in stored.turns] == [0, 1]
    tokens = torch.from_numpy(two.token_ids.astype(np.int64))
    routes = RouteFetcher(CacheSource(route_cache), geometry).routes([sample], nested([tokens]))
    assert routes.diverged.tolist() == [0]
    assert int(routes.routed.values().sum()) == stored.num_rows == two.num_rows


def test_plugin_loads_from_its_entry_point_in_a_fresh_process():
    """Faults 6 and 7: nothing in the environment (no VERL_USE_EXTERNAL_MODULES): ``import verl``
    loads the plugin through its ``verl.plugins`` entry point, as in every process of a Ray
    cluster that was started without the driver; verl's clients carry sample ids, its replica
    registry holds the route cache replica, and its engine registry returns the route cache
    engine for the Megatron backend."""
    script = (
        "import sys\n"
        "import verl\n"
        "assert 'megatron' not in sys.modules  # each change waits for its verl module\n"
        "from verl.workers.rollout.llm_server import LLMServerClient\n"
        "from verl.workers.rollout.replica import RolloutReplicaRegistry\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "import verl.workers.engine.megatron.transformer_impl\n"
        "from verl_integration import engine, plugin\n"
        "assert LLMServerClient._carries_sample_ids\n"
        "assert RolloutReplicaRegistry._registry['vllm'] is plugin.load_replica\n"
        "found = EngineRegistry.get_engine_cls('language_model', 'megatron')\n"
        "assert found is engine.engine_class(), found\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


class _Replica:
    """verl's ``RolloutReplica.__init__`` as far as the conversion reads it."""

    def __init__(self, rank, config, is_reward_model=False, is_teacher_model=False):
        import ray

        self.config = config
        self.is_reward_model = is_reward_model
        self.is_teacher_model = is_teacher_model
        self.server_class = ray.remote(StandInServer)


@pytest.mark.parametrize(
    "kind, replay, converted",
    [
        ("actor", True, True),
        ("actor", False, False),  # the generation server, or R3 off
        ("teacher", True, False),  # on-policy distillation's teacher servers
        ("reward", True, False),
    ],
)
def test_only_the_actors_replicas_with_replay_are_converted(kind, replay, converted):
    """Fault 5: verl builds teacher, reward and generation servers from the same registered
    replica class; only the actor's rollout with routing replay stores routes."""
    replica = route_cache_replica(_Replica, StandInServer)(
        0,
        SimpleNamespace(enable_rollout_routing_replay=replay),
        is_reward_model=kind == "reward",
        is_teacher_model=kind == "teacher",
    )
    mro = replica.server_class.__ray_metadata__.modified_class.__mro__
    assert (RouteCacheGenerate in mro) == converted
    if converted:  # the mix-in's generate() runs first and calls the server's
        assert mro.index(RouteCacheGenerate) < mro.index(StandInServer)


def test_the_documented_settings_compose_in_verls_config():
    """docs/verl.md's overrides, composed by hydra with verl's own trainer config: the rollout
    server's ``RolloutConfig`` (what ``RouteCacheGenerate`` reads as ``self.config``) names the
    route cache, and the job's runtime environment carries it to every actor."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from verl_integration.contract import route_cache_target
    from verl_integration.rollout import converts

    overrides = [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
        "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
        "+actor_rollout_ref.rollout.custom.route_cache=route-cache:50051",
        "+ray_kwargs.ray_init.runtime_env.env_vars.ROUTER_REPLAY_CACHE=route-cache:50051",
    ]
    with initialize_config_dir(config_dir=f"{verl.__path__[0]}/trainer/config", version_base=None):
        config = compose(config_name="ppo_megatron_trainer", overrides=overrides)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    assert route_cache_target(rollout.custom) == "route-cache:50051"
    assert (
        config.ray_kwargs.ray_init.runtime_env.env_vars.ROUTER_REPLAY_CACHE == "route-cache:50051"
    )
    assert config.actor_rollout_ref.actor.megatron.router_replay.mode == "R3"
    replica = SimpleNamespace(config=rollout, is_reward_model=False, is_teacher_model=False)
    assert converts(replica)
