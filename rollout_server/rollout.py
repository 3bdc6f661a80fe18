"""The rollout service's core, free of gRPC: generate samples, build their records, store them.

For each sample: admission (the write buffer has room, the sample id is new), generation on
the engine while token deltas stream to the caller, the record built from the engine's
``Completion`` (tokens = prompt + generated, routes ``[T - 1, num_moe_layers, topk]``, one
``Turn`` naming the policy version), queued on the ``RecordWriter``, and a final event that
says ``stored`` only once the route cache acknowledged it.

A later turn (``continue_sample``) reads the stored record, generates with the whole
conversation as the prompt, asks the engine only for the rows not stored yet
(``routes_start`` = the record's row count), and appends them at that row offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import numpy as np

from rollout_server.checks import check_range, check_sampling, prompt_token_ids
from rollout_server.engine import Completion, Engine
from rollout_server.weights import PolicyGate, check_checkpoint
from rollout_server.writer import RecordWriter
from routereplay.domain.record import Record, Turn, TurnAppend, check_sample_id
from routereplay.domain.rollout import (
    SampleDelta,
    SampleDone,
    SampleEvent,
    SampleFailed,
    SampleRequest,
    SamplingOptions,
)
from routereplay.errors import (
    AlreadyExists,
    CaptureError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RouteReplayError,
    Unavailable,
)
from routereplay.rpc.client import AsyncRouteCacheClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutLimits:
    """Attributes:
    max_n: most samples per prompt in a batch.
    max_prompts: most prompts per batch.
    store_wait_s: how long a final event waits for the cache's acknowledgement.
    capture_routes: store records (off: the engine captures nothing, nothing is stored).
    """

    max_n: int = 64
    max_prompts: int = 256
    store_wait_s: float = 60.0
    capture_routes: bool = True


@dataclass(frozen=True)
class _Turn:
    """A turn ready to generate: everything validated, the sample id reserved."""

    request: SampleRequest
    prompt: list[int]  # this turn's new prompt tokens
    history: Record | None  # the stored record a later turn continues


class Rollout:
    """Generates samples on ``engine`` and stores their records through ``writer``.

    Use from the event loop the engine is bound to.

    Args:
        engine: The generation engine.
        cache: Route cache client, for reading records (later turns, id checks).
        writer: The bounded, retrying record writer (started by the caller).
        limits: Batch sizes, store wait, capture switch.
        policy_version: Version of the weights served at start.
    """

    def __init__(
        self,
        engine: Engine,
        cache: AsyncRouteCacheClient,
        writer: RecordWriter,
        limits: RolloutLimits,
        policy_version: int = 0,
    ) -> None:
        self.engine = engine
        self.cache = cache
        self.writer = writer
        self.limits = limits
        self.gate = PolicyGate(policy_version)
        self.counters: Counter[str] = Counter()
        self._running: set[str] = set()  # sample ids generating now (reserved)

    @property
    def policy_version(self) -> int:
        return self.gate.version

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------------ public calls

    async def generate(self, request: SampleRequest) -> AsyncIterator[SampleDelta | SampleDone]:
        """One new sample: its deltas, then its ``SampleDone``.

        Raises:
            RouteReplayError: Bad input (INVALID_ARGUMENT, ALREADY_EXISTS), a full write
                buffer (UNAVAILABLE), or a capture that failed validation (INTERNAL).
        """
        self._admit()
        turn = self._prepare(request, "prompt", "sampling")
        await self._reserve([turn.request.sample_id], check_cache=bool(request.sample_id))
        async for event in self._run(turn):
            yield event

    async def generate_batch(
        self,
        prompts: Sequence[str | list[int]],
        n: int,
        options: SamplingOptions,
        sample_ids: Sequence[str] = (),
        group_ids: Sequence[str] = (),
        return_routes: bool = False,
        more_turns: bool = False,
    ) -> AsyncIterator[SampleEvent]:
        """``len(prompts) x n`` samples generated concurrently (a GRPO group per prompt).

        Events of all samples interleave; a failing sample yields ``SampleFailed`` and the
        others go on. ``sample_ids`` are prompt-major (empty: generated); ``group_ids`` one
        per prompt (empty: generated). ``more_turns``: the records are announced on the ready
        feed by their ``final`` later turn, not now.

        Raises:
            RouteReplayError: Bad input or a full write buffer, before anything runs.
        """
        self._admit()
        n = n or 1
        check_range(len(prompts), 1, self.limits.max_prompts, "prompts (count)")
        check_range(n, 1, self.limits.max_n, "n")
        total = len(prompts) * n
        if sample_ids and len(sample_ids) != total:
            raise InvalidArgument(
                f"sample_ids has {len(sample_ids)} ids; prompts x n needs {total} (or none)"
            )
        if group_ids and len(group_ids) != len(prompts):
            raise InvalidArgument(
                f"group_ids has {len(group_ids)} ids; one per prompt needs {len(prompts)}"
            )
        if len(set(sample_ids)) != len(sample_ids):
            raise InvalidArgument("sample_ids repeat an id")
        turns = []
        for p, prompt in enumerate(prompts):
            group = group_ids[p] if group_ids else uuid.uuid4().hex
            for j in range(n):
                sid = sample_ids[p * n + j] if sample_ids else ""
                request = SampleRequest(sid, group, prompt, options, return_routes, not more_turns)
                turns.append(self._prepare(request, f"prompts[{p}]", "sampling"))
        await self._reserve([t.request.sample_id for t in turns], check_cache=bool(sample_ids))
        async for event in self._run_many(turns):
            yield event

    async def continue_sample(
        self,
        sample_id: str,
        prompt: str | list[int],
        options: SamplingOptions,
        return_routes: bool = False,
        final: bool = False,
    ) -> AsyncIterator[SampleDelta | SampleDone]:
        """A new turn of a stored sample; its tokens and rows are appended to the record.
        ``final``: the sample's last turn; the record is announced on the ready feed.

        Raises:
            NotFound: The route cache has no record of ``sample_id``.
            FailedPrecondition: The sample is generating, or of another model.
            Unavailable: Its previous turn is still being written, or the buffer is full.
        """
        self._admit()
        check_sample_id(sample_id)
        if sample_id in self._running:
            raise FailedPrecondition(f"sample_id {sample_id!r} is generating a turn now")
        if self.writer.is_pending(sample_id):
            raise Unavailable(
                f"sample_id {sample_id!r}: its previous turn is still being written; retry"
            )
        self._running.add(sample_id)
        try:
            history = await self.cache.read(sample_id)
            if history.geometry != self.engine.geometry:
                raise FailedPrecondition(
                    f"sample_id {sample_id!r} was generated by another model "
                    f"({history.geometry}); this server serves {self.engine.geometry}"
                )
            request = SampleRequest(
                sample_id, history.group_id, prompt, options, return_routes, final
            )
            new = prompt_token_ids(self.engine, prompt, "prompt")
            check_sampling(self.engine, options, history.num_tokens + len(new), "sampling")
        except BaseException:
            self._running.discard(sample_id)
            raise
        async for event in self._run(_Turn(request, new, history)):
            yield event

    async def update_weights(self, path: str, version: int = 0) -> tuple[int, float, float]:
        """Load the weights at ``path`` and bump the policy version.

        Running turns finish on the old weights first; turns that arrive meanwhile wait.

        Returns:
            The new version, seconds waiting for running turns, seconds loading.
        """
        check_checkpoint(path, self.engine.moe_geometry, self.engine.model_config)
        current = self.gate.version
        new = version or current + 1
        if new <= current:
            raise InvalidArgument(f"policy_version {new} must exceed the current {current}")
        t0 = time.perf_counter()
        async with self.gate.update():
            t1 = time.perf_counter()
            await self.engine.update_weights(path)
            self.gate.version = new
        t2 = time.perf_counter()
        self.counters["weight_updates"] += 1
        log.info(
            "policy version %d from %s (drain %.2f s, load %.2f s)", new, path, t1 - t0, t2 - t1
        )
        return new, t1 - t0, t2 - t1

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        if self.writer.held_for_memory:
            self.counters["refused_memory"] += 1
            raise ResourceExhausted(
                f"{self.writer.held_for_memory} generated records wait here for room in the "
                "route cache; new generation resumes as the trainer commits what it trained "
                f"(nothing generated is lost). The route cache said: {self.writer.last_refusal}",
                retry_after_s=5.0,
            )
        if self.writer.full:
            self.counters["refused_backpressure"] += 1
            raise Unavailable(
                f"{self.writer.num_pending} record writes are waiting for the route cache "
                f"(limit {self.writer.max_pending}); retry later"
            )

    def _prepare(self, request: SampleRequest, prompt_name: str, options_name: str) -> _Turn:
        if request.sample_id:
            check_sample_id(request.sample_id)
        else:
            request = SampleRequest(
                uuid.uuid4().hex,
                request.group_id,
                request.prompt,
                request.options,
                request.return_routes,
                request.announce,
            )
        if request.group_id:
            check_sample_id(request.group_id, "group_id")
        prompt = prompt_token_ids(self.engine, request.prompt, prompt_name)
        check_sampling(self.engine, request.options, len(prompt), options_name)
        return _Turn(request, prompt, None)

    async def _reserve(self, sample_ids: list[str], check_cache: bool) -> None:
        """Claim new sample ids: not generating here, not being written, not stored.

        Generated ids (uuid4) skip the cache look-up.
        """
        taken = [s for s in sample_ids if s in self._running or self.writer.is_pending(s)]
        if taken:
            raise AlreadyExists(f"sample_id {taken[0]!r} is already in use on this server")
        self._running.update(sample_ids)
        try:
            if check_cache:
                stored = await asyncio.gather(*(self._exists(s) for s in sample_ids))
                if any(stored):
                    sid = sample_ids[stored.index(True)]
                    raise AlreadyExists(f"sample_id {sid!r} already has a record in the cache")
        except BaseException:
            self._running.difference_update(sample_ids)
            raise

    async def _exists(self, sample_id: str) -> bool:
        try:
            await self.cache.stat(sample_id)
        except NotFound:
            return False
        return True

    # ------------------------------------------------------------------ generation

    async def _run(self, turn: _Turn) -> AsyncIterator[SampleDelta | SampleDone]:
        """Generate one reserved turn; release its sample id at the end, however it ends."""
        sid = turn.request.sample_id
        try:
            self.counters["samples_started"] += 1
            done, version = None, 0
            async with contextlib.aclosing(self._engine_turn(turn)) as stream:
                async for item in stream:
                    if isinstance(item, SampleDelta):
                        yield item
                    else:
                        done, version = item
            yield await self._finish(turn, done, version)
        finally:
            self._running.discard(sid)

    async def _engine_turn(self, turn: _Turn):
        """Yields ``SampleDelta``s, then ``(Completion, policy_version)``."""
        request = turn.request
        history = turn.history
        prefix = history.token_ids.tolist() if history is not None else []
        routes_start = history.num_rows if history is not None else 0
        request_id = f"{request.sample_id}@{uuid.uuid4().hex[:8]}"
        finished = False
        async with self.gate.generation() as version:
            stream = self.engine.generate(
                request_id, prefix + turn.prompt, request.options, routes_start
            )
            try:
                async with contextlib.aclosing(stream):
                    async for item in stream:
                        if isinstance(item, Completion):
                            finished = True
                            yield item, version
                        else:
                            yield SampleDelta(request.sample_id, item)
            except CaptureError:
                self.counters["capture_failures"] += 1
                log.error("sample %s: captured routes failed validation", request.sample_id)
                raise
            finally:
                if not finished:  # the caller went away or the engine failed: stop it
                    self.counters["samples_cancelled"] += 1
                    with contextlib.suppress(Exception):
                        await asyncio.shield(self.engine.abort(request_id))

    async def _finish(self, turn: _Turn, done: Completion | None, version: int) -> SampleDone:
        request = turn.request
        history = turn.history
        if done is None:
            raise Unavailable("the engine ended the request without a result")
        generated = int(done.token_ids.size)
        self.counters["tokens_generated"] += generated
        prompt_len = len(turn.prompt)
        start = history.num_tokens if history is not None else 0
        end = start + prompt_len + generated
        turn_record = Turn(start, end, start + prompt_len, version, done.logprobs)
        result = dict(
            sample_id=request.sample_id,
            group_id=history.group_id if history is not None else request.group_id,
            finish_reason=done.finish_reason,
            prompt_tokens=prompt_len,
            generated_tokens=generated,
            turn=turn_record,
            geometry=self.engine.geometry,
            routes=done.routes if request.return_routes else None,
            row_start=done.routes_start,
            cached_tokens=done.num_cached_tokens,
        )
        if done.finish_reason == "abort" or generated == 0:
            self.counters["samples_not_stored"] += 1
            return SampleDone(
                **result,
                num_tokens=start,
                stored=False,
                store_error="generation was aborted: nothing stored",
            )
        if not self.limits.capture_routes:
            return SampleDone(
                **result,
                num_tokens=end,
                stored=False,
                store_error="route capture is off on this server",
            )
        tokens = np.asarray(turn.prompt + done.token_ids.tolist(), np.int32)
        if history is None:
            item = Record(
                request.sample_id,
                self.engine.geometry,
                tokens,
                done.routes,
                [turn_record],
                request.group_id,
            )
        else:
            item = TurnAppend(
                request.sample_id,
                self.engine.geometry,
                history.num_rows,
                tokens,
                done.routes,
                [turn_record],
            )
        stored, error = await self._store(item, request.announce)
        self.counters["samples_stored" if stored else "samples_not_stored"] += 1
        return SampleDone(**result, num_tokens=end, stored=stored, store_error=error)

    async def _store(self, item: Record | TurnAppend, announce: bool) -> tuple[bool, str]:
        future = self.writer.submit(item, announce)
        try:
            await asyncio.wait_for(asyncio.shield(future), self.limits.store_wait_s)
        except TimeoutError:
            return False, (
                f"not acknowledged within {self.limits.store_wait_s:.0f} s; the write is "
                "still being retried and may land later"
            )
        except RouteReplayError as exc:
            return False, f"not stored: {exc}"
        return True, ""

    async def _run_many(self, turns: list[_Turn]) -> AsyncIterator[SampleEvent]:
        queue: asyncio.Queue[SampleEvent | None] = asyncio.Queue()

        async def one(turn: _Turn) -> None:
            try:
                async for event in self._run(turn):
                    queue.put_nowait(event)
            except RouteReplayError as exc:
                queue.put_nowait(SampleFailed(turn.request.sample_id, exc.status, str(exc)))
            except Exception:  # noqa: BLE001 - one sample's failure must not end the batch
                log.exception("sample %s failed", turn.request.sample_id)
                queue.put_nowait(
                    SampleFailed(turn.request.sample_id, "INTERNAL", "internal error (see log)")
                )
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(one(t)) for t in turns]
        try:
            remaining = len(tasks)
            while remaining:
                event = await queue.get()
                if event is None:
                    remaining -= 1
                else:
                    yield event
        finally:
            for task in tasks:  # the caller went away: cancel every sample still running
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
