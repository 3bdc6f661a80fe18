"""verl's vLLM rollout through the route cache, as a verl plugin: with
``VERL_USE_EXTERNAL_MODULES=verl_integration.plugin`` in the environment of verl's driver,
``import verl`` imports this module, which registers the ``vllm`` rollout replica again with
``RouteCacheGenerate`` in front of verl's ``vLLMHttpServer`` (``rollout.route_cache_replica``).

Everything else keyed on the rollout name ``vllm`` stays as it is.
"""

from __future__ import annotations

from verl.workers.rollout.replica import RolloutReplicaRegistry

from verl_integration.rollout import route_cache_replica


def load_replica():
    """verl's ``vLLMReplica`` whose servers write each call's turn to the route cache."""
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

    return route_cache_replica(vLLMReplica, vLLMHttpServer)


RolloutReplicaRegistry.register("vllm", load_replica)
