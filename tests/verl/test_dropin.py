"""The rollout seam's drop-in for verl's server class, and its plugin registration.

verl's ``vLLMHttpServer`` needs a vLLM build verl supports (not installable next to verl on this
CPU machine), so the server under the mix-in here is a stand-in whose ``generate()`` returns
what verl's would: a ``TokenOutput`` from the transformers rollout, the weights' version in
``extra_fields["global_steps"]``. Everything from the mix-in on is the real thing: the asyncio
client, the route cache over a real redis-server.
"""

from __future__ import annotations

import asyncio

import numpy as np

from routereplay.dev.hf_rollout import rollout_records
from routereplay.rpc.client import AsyncRouteCacheClient, RouteCacheClient
from tests.verl.cpu import needs_verl
from tests.verl.helpers import geometry_of, token_output
from verl_integration.rollout import ID_FIELD, AsyncTurnWriter, RouteCacheGenerate

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
        server.route_writer = AsyncTurnWriter(AsyncRouteCacheClient(route_cache), geometry)
        one = await server.generate([9, 8, 7, 6], {}, "req-dropin")
        two = await server.generate(history, {}, "req-dropin")
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


def test_plugin_registers_the_route_cache_replica():
    import ray
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from verl_integration import plugin
    from verl_integration.rollout import route_cache_replica

    assert RolloutReplicaRegistry._registry["vllm"] is plugin.load_replica

    class Replica:
        def __init__(self, rank):
            self.server_class = ray.remote(StandInServer)

    replica = route_cache_replica(Replica, StandInServer)(0)
    mro = replica.server_class.__ray_metadata__.modified_class.__mro__
    # The mix-in's generate() runs first and calls the server's.
    assert RouteCacheGenerate in mro
    assert mro.index(RouteCacheGenerate) < mro.index(StandInServer)
