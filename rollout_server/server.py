"""The Rollout servicer (protobuf in, domain calls, protobuf out) and the server process."""

from __future__ import annotations

import asyncio
import logging
import signal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollout_server.config import Config
from rollout_server.engine import Engine
from rollout_server.rollout import Rollout, RolloutLimits
from rollout_server.writer import RecordWriter
from routereplay.domain.rollout import SampleRequest, ServerStatus, WeightsUpdate
from routereplay.rpc.client import AsyncRouteCacheClient, RetryPolicy
from routereplay.rpc.grpc_server import LIVENESS, make_aio_server, set_serving_aio
from routereplay.rpc.metrics import ServiceMetrics
from routereplay.rpc.rollout_wire import (
    event_to_pb,
    prompt_from_pb,
    sampling_from_pb,
    status_to_pb,
    weights_update_to_pb,
)
from routereplay.rpc.security import add_port
from routereplay.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

NAMESPACE = "rollout_server"
SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
# How often the server checks that its engine lives (a dict lookup: vLLM notices a dead engine
# process at once; this bounds how long health says otherwise).
ENGINE_CHECK_S = 0.5


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Thin: converts messages, calls ``Rollout``; domain errors become statuses in the
    interceptor."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout

    async def Generate(self, request, context):
        sample = SampleRequest(
            sample_id=request.sample_id,
            group_id=request.group_id,
            prompt=prompt_from_pb(request.prompt, "prompt"),
            options=sampling_from_pb(request.sampling),
            return_routes=request.return_routes,
            announce=not request.more_turns,
        )
        async for event in self.rollout.generate(sample):
            yield event_to_pb(event)

    async def GenerateBatch(self, request, context):
        prompts = [prompt_from_pb(p, f"prompts[{i}]") for i, p in enumerate(request.prompts)]
        events = self.rollout.generate_batch(
            prompts,
            request.n,
            sampling_from_pb(request.sampling),
            list(request.sample_ids),
            list(request.group_ids),
            request.return_routes,
            request.more_turns,
        )
        async for event in events:
            yield event_to_pb(event)

    async def Continue(self, request, context):
        events = self.rollout.continue_sample(
            request.sample_id,
            prompt_from_pb(request.prompt, "prompt"),
            sampling_from_pb(request.sampling),
            request.return_routes,
            request.final,
        )
        async for event in events:
            yield event_to_pb(event)

    async def UpdateWeights(self, request, context):
        version, drain_s, load_s = await self.rollout.update_weights(
            request.path, request.policy_version
        )
        return weights_update_to_pb(WeightsUpdate(version, drain_s, load_s))

    async def GetStatus(self, request, context):
        rollout = self.rollout
        counters = {**rollout.counters, **rollout.writer.counters}
        status = ServerStatus(
            geometry=rollout.engine.geometry,
            policy_version=rollout.policy_version,
            max_model_len=rollout.engine.max_model_len,
            running=rollout.num_running,
            pending_writes=rollout.writer.num_pending,
            max_pending_writes=rollout.writer.max_pending,
            counters=counters,
        )
        return status_to_pb(status)


class _RolloutCollector:
    """The rollout's counters (``GetStatus``'s, tokens generated and capture failures among
    them), its write buffer and policy version, read at each scrape."""

    def __init__(self, rollout: Rollout):
        self.rollout = rollout

    def collect(self):
        rollout = self.rollout
        counters = CounterMetricFamily(
            f"{NAMESPACE}_events",
            "Rollout events by kind (tokens_generated: generated "
            "tokens, whose rate is tokens/s; capture_failures; samples_stored; ...)",
            labels=["event"],
        )
        for name, count in sorted({**rollout.counters, **rollout.writer.counters}.items()):
            counters.add_metric([name], count)
        yield counters
        yield GaugeMetricFamily(
            f"{NAMESPACE}_pending_writes",
            "Record writes waiting or retrying (write buffer)",
            value=rollout.writer.num_pending,
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_max_pending_writes",
            "The write buffer's bound",
            value=rollout.writer.max_pending,
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_policy_version",
            "Version of the weights being served",
            value=rollout.policy_version,
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_running_samples", "Samples generating now", value=rollout.num_running
        )


class RolloutServer:
    """The rollout server: ``await start()``, then ``await stop(grace)`` or ``await wait()``.

    Runs on the event loop the engine is bound to. The route cache client is created here
    (on this loop) from ``config.route_cache`` and ``config.route_cache_security``.

    If the engine dies, every health name turns NOT_SERVING, liveness included, and ``wait``
    returns as on SIGTERM (``engine_died`` set): the process stops gracefully (pending record
    writes still land) and exits with an error, so the pod or container is restarted. A dead
    engine never comes back in the same process.

    Args:
        config: The server's settings.
        engine: A started engine (the caller owns it and shuts it down).
    """

    def __init__(self, config: Config, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.cache: AsyncRouteCacheClient | None = None
        self.write_cache: AsyncRouteCacheClient | None = None
        self.rollout: Rollout | None = None
        self.port = 0
        self._server = None
        self._health = None
        self.metrics: ServiceMetrics | None = None
        self.engine_died = False
        self._stopping: asyncio.Event | None = None
        self._engine_watch: asyncio.Task | None = None

    async def start(self) -> RolloutServer:
        config = self.config
        self.cache = AsyncRouteCacheClient(
            config.route_cache,
            timeout_s=config.cache_timeout_s,
            security=config.route_cache_security,
        )
        # The record writer retries each write itself, with its own budget (write_retry_s),
        # backoff and counters (write_retries): its client tries once, so an outage shows in
        # those counters instead of being ridden through unseen inside the client's retries.
        self.write_cache = AsyncRouteCacheClient(
            config.route_cache,
            timeout_s=config.cache_timeout_s,
            retry=RetryPolicy(attempts=1),
            security=config.route_cache_security,
        )
        writer = RecordWriter(
            self.write_cache,
            config.max_pending_writes,
            config.write_workers,
            config.write_retry_s,
        )
        limits = RolloutLimits(
            config.max_n, config.max_prompts, config.store_wait_s, config.capture_routes
        )
        self.rollout = Rollout(self.engine, self.cache, writer, limits, config.policy_version)
        self.metrics = ServiceMetrics(NAMESPACE)
        self.metrics.registry.register(_RolloutCollector(self.rollout))
        self._server, self._health = await make_aio_server(
            config.limits, [SERVICE_NAME], config.security, self.metrics
        )
        rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(self.rollout), self._server)
        self.port = add_port(self._server, f"{config.host}:{config.port}", config.security)
        writer.start()
        self._stopping = asyncio.Event()
        await self._server.start()
        await set_serving_aio(self._health, [SERVICE_NAME], True)
        self._engine_watch = asyncio.create_task(self._watch_engine(), name="engine-watch")
        self.metrics.serve(config.metrics)
        log.info("rollout server listening on %s:%d", config.host, self.port)
        return self

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting calls, let running ones and pending record writes finish."""
        grace = self.config.grace_s if grace_s is None else grace_s
        if self._server is None:
            return
        self._engine_watch.cancel()
        await set_serving_aio(self._health, [SERVICE_NAME], False)
        await self._server.stop(grace)
        await self.rollout.writer.stop(grace)
        await self.write_cache.close()
        await self.cache.close()
        self.metrics.stop()
        self._server = None

    async def wait(self) -> None:
        """Serve until SIGTERM or SIGINT, or the engine dies; then stop gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        await self._stopping.wait()
        log.info("stopping: finishing in-flight calls (grace %.0f s)", self.config.grace_s)
        await self.stop()

    async def _watch_engine(self) -> None:
        while self.engine.alive:
            await asyncio.sleep(ENGINE_CHECK_S)
        self.engine_died = True
        log.error("the generation engine died: every health name NOT_SERVING; stopping")
        await set_serving_aio(self._health, [SERVICE_NAME, LIVENESS], False)
        self._stopping.set()
