"""The record writer: a bounded buffer of record writes, retried while the route cache is
slow or down.

Generation never blocks on the cache: a finished sample's record is queued and written by a
few worker tasks, each write retried with backoff until it lands or ``retry_for_s`` passes.
The buffer is bounded: when ``max_pending`` writes wait, ``full`` turns true and the server
refuses new generation calls with UNAVAILABLE instead of growing without bound. A write's
future resolves only with the cache's acknowledgement, so a caller never reports a record
as stored when it is not.

A write refused at the route cache's memory budget (RESOURCE_EXHAUSTED with a retry time) is
not a failure: the cache is up, and memory comes back as the trainer commits. It is retried
after the time the cache named, for as long as it takes (``retry_for_s`` does not apply), and
while any write waits so, ``held_for_memory`` is true and the server admits no new generation
(RESOURCE_EXHAUSTED, saying why): what was generated waits here, nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass

from routereplay.domain.record import Record, TurnAppend
from routereplay.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RouteReplayError,
    Unavailable,
)
from routereplay.rpc.client import AsyncRouteCacheClient, WriteResult

log = logging.getLogger(__name__)

# Answers that another try cannot change: the write is wrong, not the cache unavailable.
_FINAL = (InvalidArgument, AlreadyExists, FailedPrecondition, NotFound)


@dataclass
class _Job:
    item: Record | TurnAppend
    done: asyncio.Future
    queued_at: float
    announce: bool = True


class RecordWriter:
    """Writes records and turn appends to the route cache in the background.

    Args:
        cache: The route cache client (its own retries cover short blips).
        max_pending: Writes queued or in progress beyond which ``full`` is true.
        workers: Concurrent writes.
        retry_for_s: A write failing with a retryable error is tried again until this
            long after it was queued, then given up (its future fails with Unavailable).
        max_backoff_s: Longest pause between two tries of one write.
    """

    def __init__(
        self,
        cache: AsyncRouteCacheClient,
        max_pending: int = 256,
        workers: int = 4,
        retry_for_s: float = 600.0,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.cache = cache
        self.max_pending = max_pending
        self.retry_for_s = retry_for_s
        self.max_backoff_s = max_backoff_s
        self.counters: Counter[str] = Counter()
        self._num_workers = workers
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._pending: dict[str, _Job] = {}
        self._workers: list[asyncio.Task] = []
        self._held: set[str] = set()  # samples whose write waits for the cache's memory
        self.last_refusal = ""  # what the cache said when it last held a write back

    @property
    def num_pending(self) -> int:
        """Writes queued or in progress."""
        return len(self._pending)

    @property
    def full(self) -> bool:
        return len(self._pending) >= self.max_pending

    @property
    def held_for_memory(self) -> int:
        """Writes waiting for the route cache's memory budget (refused, to be retried)."""
        return len(self._held)

    def is_pending(self, sample_id: str) -> bool:
        return sample_id in self._pending

    def start(self) -> None:
        """Start the worker tasks on the running event loop."""
        if not self._workers:
            self._workers = [
                asyncio.create_task(self._work(), name=f"record-writer-{i}")
                for i in range(self._num_workers)
            ]

    async def stop(self, grace_s: float) -> None:
        """Let queued writes finish for up to ``grace_s`` seconds, then cancel the rest."""
        deadline = time.monotonic() + grace_s
        while self._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._pending:
            log.warning("stopping with %d record writes not done", len(self._pending))
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        for job in self._pending.values():
            if not job.done.done():
                job.done.set_exception(Unavailable("the server stopped before the write landed"))
        self._pending.clear()

    def submit(
        self, item: Record | TurnAppend, announce: bool = True
    ) -> asyncio.Future[WriteResult]:
        """Queue a write; never blocks. The future resolves with the cache's answer.
        ``announce``: the route cache announces the record on its ready feed once this write
        lands (a record: unless False, more turns to come; an append: only if True, the last).

        Callers check ``full`` before they start generating (admission control); a sample
        already generated is always accepted, so the buffer can exceed ``max_pending`` by
        at most the number of samples that were running when it filled.
        """
        future: asyncio.Future[WriteResult] = asyncio.get_running_loop().create_future()
        # A caller that stopped waiting must not leave "exception never retrieved" noise.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        job = _Job(item, future, time.monotonic(), announce)
        self._pending[item.sample_id] = job
        self._queue.put_nowait(job)
        self.counters["writes_queued"] += 1
        return future

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                result = await self._write(job)
            except RouteReplayError as exc:
                self.counters["writes_failed"] += 1
                log.error("record %s not stored: %s", job.item.sample_id, exc)
                if not job.done.done():
                    job.done.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - one bad write must not stop the worker
                self.counters["writes_failed"] += 1
                log.exception("record %s not stored", job.item.sample_id)
                if not job.done.done():
                    job.done.set_exception(exc)
            else:
                self.counters["writes_stored"] += 1
                if not job.done.done():
                    job.done.set_result(result)
            finally:
                self._pending.pop(job.item.sample_id, None)
                self._held.discard(job.item.sample_id)

    async def _write(self, job: _Job) -> WriteResult:
        attempt = 0
        while True:
            try:
                if isinstance(job.item, Record):
                    return await self.cache.write(job.item, more_turns=not job.announce)
                return await self.cache.append(job.item, final=job.announce)
            except _FINAL:
                raise
            except ResourceExhausted as exc:
                if exc.retry_after_s is None:  # a limit of the cache's, not its memory
                    raise
                self._held.add(job.item.sample_id)
                self.last_refusal = str(exc)
                self.counters["writes_held_for_memory"] += 1
                log.warning("record %s: %s", job.item.sample_id, exc)
                await asyncio.sleep(min(exc.retry_after_s, 10.0) * (0.5 + random.random()))
                continue
            except RouteReplayError as exc:
                waited = time.monotonic() - job.queued_at
                if waited >= self.retry_for_s:
                    raise Unavailable(
                        f"route cache unavailable for {waited:.0f} s; gave up: {exc}"
                    ) from None
                self.counters["write_retries"] += 1
                backoff = min(self.max_backoff_s, 0.05 * 2**attempt) * (0.5 + random.random() / 2)
                attempt += 1
                log.warning("record %s: retrying in %.2f s (%s)", job.item.sample_id, backoff, exc)
                await asyncio.sleep(backoff)
