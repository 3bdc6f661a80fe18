"""verl's plugin: installing the project registers this module under verl's ``verl.plugins``
entry points (``pyproject.toml``), and ``import verl`` imports it in every process of a verl job
(driver, TaskRunner, agent loop workers, rollout servers, trainer workers), on any Ray cluster,
started by the driver or not. ``VERL_USE_EXTERNAL_PLUGINS`` (verl's own switch) can leave it out.

It does six things, each keyed on verl's own extension points:

- the ``vllm`` rollout replica is registered again (``RolloutReplicaRegistry``), with
  ``RouteCacheGenerate`` in front of ``vLLMHttpServer`` on the actor's replicas that have
  routing replay on (``rollout.converts``);
- verl's ``LLMServerClient._vllm_request_id`` (its hook for the id sent to the server) keeps
  verl's fresh per-call id and carries the agent loop's per-sample id inside it
  (``rollout.tag_request_id``), and ``FullyAsyncLLMServerClient.generate``, which rebuilds the
  output of a resumed partial rollout, keeps the sample's id in ``extra_fields``;
- the trainer's engine is registered for verl's Megatron backend (``engine.register_engine``);
- verl's ``get_rollout_replica_class`` logs an error where the route cache is configured and a
  disaggregated prefill/decode replica is asked for (verl builds it without the registry, so its
  routes go through Ray; ``warn_disaggregated``);
- verl's agent-loop workers (V0 ``AgentLoopWorker``, V1 ``AgentLoopWorkerTQ``) mark their
  validation batches, whose calls the servers then never store (``mark_validation``);
- V1's replay buffer frees the records of the groups it drops untrained: stale, DAPO-filtered
  and surplus groups (``free_dropped_groups``).

Each change is made right after verl imports the module it changes (``when_imported``), so
``import verl`` itself imports nothing more (measured: ``import verl`` took 9.2-9.6 s with the
changes made at once, importing verl's rollout client and Megatron engine, against 4.8 s without).
verl swallows a plugin's import error (logged at debug level), so a failure here is logged as
a warning, naming what was not installed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import logging
import sys
from collections.abc import Callable
from contextvars import ContextVar
from types import ModuleType

from verl_integration.contract import ID_FIELD, RAY_ROUTES_ENV, route_cache_target
from verl_integration.rollout import route_cache_replica, tag_request_id

logger = logging.getLogger(__name__)


def load_replica():
    """verl's ``vLLMReplica`` whose actor servers write each call's turn to the route cache."""
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

    return route_cache_replica(vLLMReplica, vLLMHttpServer)


def _deterministic(client) -> bool:
    return bool(getattr(client.config.actor_rollout_ref.rollout, "full_determinism", False))


def carry_sample_ids(client_cls, resuming_client_cls) -> None:
    """Make verl's clients carry the agent loop's sample id to the server (idempotent).

    Under ``full_determinism`` verl names every request ``det-{priority}``, one id for all
    samples: nothing is carried, and the server refuses the call."""
    if getattr(client_cls, "_carries_sample_ids", False):
        return
    fresh_id = client_cls._vllm_request_id

    def _vllm_request_id(self, request_id: str) -> str:
        sent = fresh_id(self, request_id)
        if _deterministic(self):
            return sent
        return tag_request_id(request_id, sent, validation=VALIDATING.get())

    generate = resuming_client_cls.generate

    @functools.wraps(generate)
    async def resuming_generate(self, request_id, **kwargs):
        output = await generate(self, request_id, **kwargs)
        rollout = self.config.actor_rollout_ref.rollout
        # Even with no tokens (aborted before the first, partial_rollout=False): the trainer
        # needs the id to tell the sample from one generated without the integration.
        if rollout.enable_rollout_routing_replay and not _deterministic(self):
            output.extra_fields.setdefault(ID_FIELD, request_id)
        return output

    client_cls._vllm_request_id = _vllm_request_id
    resuming_client_cls.generate = resuming_generate
    client_cls._carries_sample_ids = True


VALIDATING: ContextVar[bool] = ContextVar("router_replay_validating", default=False)
"""True inside a validation batch of verl's agent-loop workers (``mark_validation``): the tasks
they start inherit it, and their calls' request ids say so (``tag_request_id``)."""


def _validating(batch) -> bool:
    """verl's validation flag: V0's ``DataProto.meta_info["validate"]``, V1's
    ``batch["validate"]`` (a ``TensorDict``)."""
    meta = getattr(batch, "meta_info", None)
    if meta is not None:
        return bool(meta.get("validate", False))
    if "validate" in batch.keys():
        value = batch["validate"]
        return bool(getattr(value, "data", value))
    return False


def mark_validation(worker_cls) -> None:
    """verl's agent-loop worker runs validation batches over the same clients and servers as
    training ones; its ``generate_sequences`` now sets ``VALIDATING`` for what it starts, so the
    servers store nothing for validation (idempotent)."""
    worker_cls = getattr(
        getattr(worker_cls, "__ray_metadata__", None), "modified_class", worker_cls
    )
    if "_marks_validation" in vars(worker_cls):
        return
    generate = worker_cls.generate_sequences

    @functools.wraps(generate)
    async def generate_sequences(self, batch, *args, **kwargs):
        token = VALIDATING.set(_validating(batch))
        try:
            return await generate(self, batch, *args, **kwargs)
        finally:
            VALIDATING.reset(token)

    worker_cls.generate_sequences = generate_sequences
    worker_cls._marks_validation = True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook right after a module's own code, so the plugin changes verl's classes
    without importing them (and megatron) in every process at ``import verl``."""

    def __init__(self):
        self.hooks: dict[str, Callable[[ModuleType], None]] = {}

    def find_spec(self, name, path, target=None):
        hook = self.hooks.pop(name, None)
        if hook is None:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_hook(module):
            exec_module(module)
            _run(hook, module)

        spec.loader.exec_module = exec_then_hook
        return spec


_AFTER_IMPORT = _AfterImport()


def _run(hook, module) -> None:
    try:
        hook(module)
    except Exception:  # verl would hide it: say what is missing
        logger.warning("router-replay's verl plugin: %s failed", hook.__name__, exc_info=True)


def when_imported(name: str, hook: Callable[[ModuleType], None]) -> None:
    """``hook(module)`` once module ``name`` is imported (now, if it already is)."""
    if name in sys.modules:
        _run(hook, sys.modules[name])
        return
    if _AFTER_IMPORT not in sys.meta_path:
        sys.meta_path.insert(0, _AFTER_IMPORT)
    _AFTER_IMPORT.hooks[name] = hook


def register_replica(replica) -> None:
    replica.RolloutReplicaRegistry.register("vllm", load_replica)
    warn_disaggregated(replica)


def warn_disaggregated(replica) -> None:
    """verl's ``get_rollout_replica_class`` returns its disaggregated prefill/decode replica
    (``vLLMPDReplica``) without the registry above: its servers keep verl's ``generate()``, and
    R3 routes travel through Ray. Said loudly where the route cache is configured; the trainer
    engine refuses such batches (``engine.ray_routes_arrived``). Idempotent."""
    resolve = replica.get_rollout_replica_class
    if getattr(resolve, "_warns_disaggregated", False):
        return

    @functools.wraps(resolve)
    def get_rollout_replica_class(rollout, disaggregation_enabled=False):
        if disaggregation_enabled and route_cache_target() is not None:
            logger.error(
                "router-replay: rollout.disaggregation.enabled builds verl's %r PD replica "
                "without the route cache: its routes go through Ray, and the trainer engine "
                "refuses them unless %s=use",
                rollout,
                RAY_ROUTES_ENV,
            )
        return resolve(rollout, disaggregation_enabled)

    get_rollout_replica_class._warns_disaggregated = True
    replica.get_rollout_replica_class = get_rollout_replica_class


def patch_clients(llm_server) -> None:
    carry_sample_ids(llm_server.LLMServerClient, llm_server.FullyAsyncLLMServerClient)
    # llm_server binds the function by name at its import: the wrapped one.
    from verl.workers.rollout import replica

    warn_disaggregated(replica)
    llm_server.get_rollout_replica_class = replica.get_rollout_replica_class


def mark_v0_validation(agent_loop) -> None:
    mark_validation(agent_loop.AgentLoopWorker)


def mark_v1_validation(agent_loop_tq) -> None:
    mark_validation(agent_loop_tq.AgentLoopWorkerTQ)


def free_dropped_groups(buffer_cls) -> None:
    """V1's ``ReplayBuffer._clear_groups`` drops groups that will never train: stale (off-policy
    beyond ``max_off_policy_threshold``), DAPO-filtered (no reward signal), failed, and the
    surplus of a refill. Before verl clears them from TransferQueue, their samples' records are
    deleted from the route cache, instead of living out its ``--ttl-s``. A failed group without
    trajectories names no sample (the agent loop's id lives only in a trajectory's
    ``extra_fields``): its records do live out the TTL. A route cache that cannot be reached
    costs a warning, never the step (idempotent)."""
    if "_frees_records" in vars(buffer_cls):
        return
    clear = buffer_cls._clear_groups

    @functools.wraps(clear)
    def _clear_groups(self, partition_id, uids):
        target = route_cache_target()
        if uids and partition_id != "val" and target is not None:
            keys = [k for k in self.partitions[partition_id] if k.split("_")[0] in uids]
            _free_records(target, keys, partition_id)
        return clear(self, partition_id, uids)

    buffer_cls._clear_groups = _clear_groups
    buffer_cls._frees_records = True


def _free_records(target: str, keys: list[str], partition_id: str) -> None:
    """Delete the route cache records of TransferQueue's trajectories ``keys``."""
    if not keys:
        return
    import transfer_queue as tq

    from routereplay.errors import NotFound
    from routereplay.rpc.client import RouteCacheClient
    from verl_integration.engine import row_ids

    try:
        data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["extra_fields"])
        samples = sorted({s for s in row_ids(data) if s is not None})
        with RouteCacheClient(target) as client:
            for sample in samples:
                with contextlib.suppress(NotFound):  # an abort before its first token
                    client.delete(sample)
        logger.info("router-replay: freed the records of %d dropped samples", len(samples))
    except Exception:
        logger.warning(
            "router-replay: the records of %d dropped trajectories were not freed (they live out "
            "the route cache's --ttl-s)",
            len(keys),
            exc_info=True,
        )


def free_v1_dropped_groups(replay_buffer) -> None:
    free_dropped_groups(replay_buffer.ReplayBuffer)


def register_engine(transformer_impl) -> None:
    from verl_integration import engine

    engine.register_engine()


when_imported("verl.workers.rollout.replica", register_replica)
when_imported("verl.workers.rollout.llm_server", patch_clients)
when_imported("verl.workers.engine.megatron.transformer_impl", register_engine)
when_imported("verl.experimental.agent_loop.agent_loop", mark_v0_validation)
when_imported("verl.trainer.ppo.v1.agent_loop_tq", mark_v1_validation)
when_imported("verl.trainer.ppo.v1.replay_buffer", free_v1_dropped_groups)
