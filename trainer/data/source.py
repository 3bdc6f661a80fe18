"""Where a step's samples and rollout routes come from (docs/architecture.md, trainer step 1).

A batch is a list of sample ids. Its records (tokens, generated turns, the rollout's log-probs
and routes) come from the route cache in one ``read_batch`` call per batch, or from a records
file (``router_replay.replay_file`` / ``data.records_file``, written by ``save_records``).
``Prefetcher`` fetches batch i + 1 in a background thread while batch i trains.

Missing records (``routereplay.domain.record_checks.decide_missing`` decides, for the verl glue
too): ``missing_record=error`` fails the batch, naming the samples, before any training.
``missing_record=native`` counts and logs them; a sample whose tokens come from a feed
(``BatchPlan.samples``) is then trained with native routing, and a sample known only by its id
(nothing to train on without its record) is dropped from the batch. A sample read from the
ready feed (``BatchPlan.published``) whose record is gone is dropped and dead-lettered under
either policy: the batch trains the rest, and the job never fails on it again at every restart.
Never "expert 0, k times".
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from routereplay.domain.record import Record
from routereplay.domain.record_checks import MISSING_RECORD_REASON, decide_missing
from routereplay.domain.record_file import load_records
from trainer.config import MissingRecord, TrainerConfig
from trainer.data.feed_log import FeedLog, steps_checkpointed

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """What the RL step trains on.

    Attributes:
        sample_id: The route cache's key.
        group_id: The GRPO group (advantages are normalised within it).
        token_ids: int32 ``[T]``, every turn's tokens.
        generated: bool ``[T]``, True on tokens the policy generated.
        rollout_logprobs: float32 ``[T]``, the rollout engine's log-prob of each generated token
            (NaN elsewhere and where the engine did not report one).
    """

    sample_id: str
    group_id: str
    token_ids: np.ndarray
    generated: np.ndarray
    rollout_logprobs: np.ndarray

    @classmethod
    def from_record(cls, record: Record) -> Sample:
        size = record.token_ids.size
        generated = np.zeros(size, bool)
        logprobs = np.full(size, np.nan, np.float32)
        for turn in record.turns:
            generated[turn.generated_start : turn.token_end] = True
            if turn.logprobs.size:
                logprobs[turn.generated_start : turn.token_end] = turn.logprobs
        return cls(record.sample_id, record.group_id, record.token_ids, generated, logprobs)


@dataclass
class BatchPlan:
    """One batch to fetch: its sample ids, and the samples when a feed supplies them (else the
    samples are built from the records)."""

    sample_ids: list[str]
    samples: list[Sample] | None = None
    published: bool = False  # read from the ready feed: a missing record is dead-lettered


@dataclass
class FetchedBatch:
    """A batch ready to train: samples and their records (None where missing, native routing).

    Attributes:
        samples: The samples to train on, in batch order.
        records: The rollout's record of each sample, or None.
        missing: Ids without a record (``missing_record=native``).
        dropped: Ids dropped because neither a record nor a fed sample exists.
        dead_letters: Of ``dropped``, the published samples, to dead-letter on the feed.
        fetch_s: Seconds the fetch itself took (in the background when prefetched).
        wait_s: Seconds the training loop waited for it.
        route_bytes: Route bytes this rank read from the route cache for it (0 where another
            rank of its group read them, or they came from a file).
    """

    samples: list[Sample]
    records: list[Record | None]
    missing: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    dead_letters: list[str] = field(default_factory=list)
    fetch_s: float = 0.0
    wait_s: float = 0.0
    route_bytes: int = 0


class CacheSource:
    """Records from the route cache: one ``read_batch`` call per batch. ``security``: a
    ``routereplay.rpc.security.ClientSecurity`` (default: plaintext). ``expire_after_s``: each
    record fetched expires at most that long after (a trainer without the ready feed frees
    what it fetched). Under model parallelism the trainer reads it through
    ``trainer.data.stage_reads`` (each stage's layers, once)."""

    reads = True  # this rank's fetches are route cache reads (FetchedBatch.route_bytes)

    def __init__(
        self, target: str, timeout_s: float = 60.0, security=None, expire_after_s: float = 0.0
    ):
        from routereplay.rpc.client import RouteCacheClient
        from routereplay.rpc.security import PLAINTEXT

        self.client = RouteCacheClient(target, timeout_s=timeout_s, security=security or PLAINTEXT)
        self.expire_after_s = expire_after_s

    def fetch(
        self, sample_ids: Sequence[str], layers: Sequence[int] | None = None
    ) -> list[Record | None]:
        """The records (None where missing); ``layers``: only these MoE layer positions."""
        from routereplay.domain.record import Missing

        items = self.client.read_batch(
            list(sample_ids), skip_missing=True, layers=layers, expire_after_s=self.expire_after_s
        )
        return [None if isinstance(item, Missing) else item for item in items]

    def close(self) -> None:
        self.client.close()


class FileSource:
    """Records from a file written by ``save_records`` (``.npz`` or ``.pt``)."""

    reads = False

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records = {r.sample_id: r for r in load_records(self.path)}

    def fetch(self, sample_ids: Sequence[str]) -> list[Record | None]:
        return [self.records.get(s) for s in sample_ids]

    def close(self) -> None:
        pass


def open_source(config: TrainerConfig) -> CacheSource | FileSource:
    """The records' source: a file (``replay_file`` or ``data.records_file``) or the cache."""
    path = config.router_replay.replay_file or config.data.records_file
    if path:
        return FileSource(path)
    return CacheSource(config.route_cache.target, security=config.route_cache.security())


def resolve(plan: BatchPlan, records: list[Record | None], missing: str) -> FetchedBatch:
    """Apply the missing-record policy (``decide_missing``) and pair samples with records.

    Raises:
        NotFound: a record is missing under ``missing="error"`` (not a published sample).
    """
    absent = decide_missing(
        plan.sample_ids,
        records,
        MissingRecord(missing),
        tokens_known=plan.samples is not None,
        published=plan.published,
    )
    if absent.native:
        log.warning(
            "%d samples without a record route natively: %s", len(absent.native), absent.native[:8]
        )
    if absent.dropped:
        log.warning(
            "%d samples without a record train nothing%s: %s",
            len(absent.dropped),
            " (dead-lettered on the ready feed)" if absent.dead_letter else "",
            absent.dropped[:8],
        )
    if plan.samples is not None:
        if [s.sample_id for s in plan.samples] != list(plan.sample_ids):
            raise ValueError("BatchPlan.samples must be in the order of sample_ids")
        return FetchedBatch(list(plan.samples), list(records), absent.native)
    kept = [r for r in records if r is not None]
    dead = absent.dropped if absent.dead_letter else []
    samples = [Sample.from_record(r) for r in kept]
    return FetchedBatch(samples, kept, absent.dropped, absent.dropped, dead)


class Prefetcher:
    """Iterate over fetched batches in plan order, fetching the next one in a background thread
    while the caller trains on the current one.

    Args:
        source: ``fetch(sample_ids) -> list[Record | None]`` and ``reads`` (whether its
            fetches read the route cache): ``CacheSource``, ``FileSource``, ``StageReads``.
        plans: The batches, in order.
        missing: The missing-record policy (``error`` or ``native``).
        prefetch: Fetch ahead (False fetches each batch when it is asked for).
    """

    def __init__(self, source, plans: Iterable[BatchPlan], missing: str, prefetch: bool = True):
        self.source = source
        self.plans = iter(plans)
        self.missing = missing
        self.prefetch = prefetch
        self.events: list[tuple[str, int, float]] = []  # (what, batch index, monotonic time)
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")

    def _note(self, what: str, index: int) -> None:
        with self._lock:
            self.events.append((what, index, time.monotonic()))

    def _fetch(self, index: int, plan: BatchPlan) -> FetchedBatch:
        self._note("fetch_start", index)
        start = time.perf_counter()
        records = self.source.fetch(plan.sample_ids)
        fetched = resolve(plan, records, self.missing)
        fetched.fetch_s = time.perf_counter() - start
        if self.source.reads:
            fetched.route_bytes = sum(r.routes.nbytes for r in records if r is not None)
        self._note("fetch_end", index)
        return fetched

    def _submit(self, index: int):
        plan = next(self.plans, None)
        return None if plan is None else self._pool.submit(self._fetch, index, plan)

    def __iter__(self) -> Iterator[FetchedBatch]:
        try:
            index = 0
            pending = self._submit(index)
            while pending is not None:
                self._note("wanted", index)
                start = time.perf_counter()
                fetched = pending.result()
                fetched.wait_s = time.perf_counter() - start
                if self.prefetch:
                    pending = self._submit(index + 1)
                    yield fetched
                else:
                    yield fetched
                    pending = self._submit(index + 1)
                index += 1
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


class FeedPlans:
    """Batches of whole GRPO groups from the route cache's ready feed (``data.source=feed``).

    The lead (DP rank 0, TP rank 0) alone reads the feed, as the one consumer
    ``data.consumer`` of ``data.consumer_group``, and hands every rank of the world the batch's
    sample ids (one broadcast: the TP and EP ranks of each DP group need them too); each rank
    then fetches and trains its DP group's share (``DataParallel``). One
    consumer rather than one per rank: all of a group's entries must reach one consumer to
    complete it, and a plan made in one place cannot give a group to two ranks, nor leave a
    rank idle while another holds a group.

    After each step (and its checkpoint) the training loop calls ``ack``, which acknowledges
    on the feed only the batches a checkpoint covers (``train.checkpoint_dir``; without one,
    each batch once trained): a job killed after an un-checkpointed step resumes from the
    checkpoint before it, and the feed gives the step's entries back, still pending, to the
    restarted consumer of the same name. The batches handed out are logged beside the
    checkpoints (``trainer.data.feed_log``) before they train, so a job killed between a
    checkpoint and its acknowledgement acknowledges the covered entries when it resumes
    instead of training them again. Delivery per sample: exactly once in the steps the
    final weights descend from; a step trained after the last checkpoint of a killed job is
    discarded and its samples trained again. Repeats of trained samples are dropped by
    sample id (``ReadyConsumer``; after a resume, every sample the log covers). A batch is
    read when the loop wants it, never ahead: in an on-policy loop the next batch is
    generated with the weights this step pushes.

    Args:
        config: The trainer configuration (``data.*``, ``train.batch_size``, the cache).
        dp: The data-parallel group (and the model-parallel place).
        client: A ``RouteCacheClient`` for the lead (default: one to ``route_cache.target``).
    """

    def __init__(self, config, dp, client=None):
        data = config.data
        self.dp = dp
        self.groups_per_batch = config.train.batch_size // data.group_size
        self.wait_s = data.wait_s
        # The lead: step -> its batch's ReadyGroups, handed out and not acknowledged.
        self.handed_out: dict[int, list] = {}
        self.dead_letters: dict[int, list[str]] = {}  # step -> its samples with no record
        self.consumer = None
        self._own_client = None
        self.log: FeedLog | None = None
        # The step the next batch is for, the next step ``ack`` reports, the steps acknowledged.
        self.step = self._reported = self._acked = 0
        self.discarded_steps: list[int] = []  # trained by a killed job, not checkpointed
        self.resumed = None  # what the feed log said at the start (``feed_log.Resumed``)
        if dp.lead:
            from routereplay.rpc.client import RouteCacheClient
            from routereplay.rpc.ready import ReadyConsumer

            checkpoints = config.train.checkpoint_dir
            if checkpoints:  # what a killed job handed out, read before the feed is opened
                self.log = FeedLog(checkpoints)
                done = steps_checkpointed(checkpoints) if config.train.resume else 0
                self.resumed = self.log.resume(done)
                self.discarded_steps = self.resumed.discarded_steps
                self.step = self._reported = self._acked = done
            if client is None:
                client = self._own_client = RouteCacheClient(
                    config.route_cache.target, security=config.route_cache.security()
                )
            self.consumer = ReadyConsumer(
                client,
                data.consumer_group,
                data.consumer,
                data.group_size,
                start_from_latest=data.start_from_latest,
            )
            if self.resumed is not None:
                resumed = self.resumed
                self.consumer.covered(
                    resumed.entries,
                    resumed.samples,
                    resumed.groups,
                    resumed.dead,
                    MISSING_RECORD_REASON,
                )

    def __iter__(self) -> Iterator[BatchPlan]:
        while (plan := self.next_plan()) is not None:
            yield plan

    def next_plan(self) -> BatchPlan | None:
        """The next batch on every rank; None on every rank when none came within ``wait_s``."""
        ids = None
        if self.consumer is not None:
            groups = self.consumer.next_groups(self.groups_per_batch, self.wait_s)
            if len(groups) == self.groups_per_batch:
                if self.log is not None:  # before the step trains: a resume must know it
                    self.log.handed_out(self.step, groups)
                self.handed_out[self.step] = groups
                self.step += 1
                ids = [sample_id for group in groups for sample_id in group.sample_ids]
            else:  # left pending: a restarted consumer gets them back
                log.warning(
                    "%d of %d groups came from the feed within %.0f s: stopping",
                    len(groups),
                    self.groups_per_batch,
                    self.wait_s,
                )
        ids = self.dp.from_lead(ids)
        return None if ids is None else BatchPlan(ids, published=True)

    def dead_letter(self, dead_letters: Sequence[str]) -> None:
        """The oldest batch handed out trained nothing for ``dead_letters`` (record lost): they
        are settled to the feed's dead-letter stream with its acknowledgement, and written to
        the feed log now, before the step's checkpoint, so a job killed between the checkpoint
        and the acknowledgement settles them when it resumes (the lead; a no-op elsewhere)."""
        if self.consumer is None or not dead_letters:
            return
        step = self._reported
        self.dead_letters[step] = list(dead_letters)
        if self.log is not None:
            dead = set(dead_letters)
            pairs = [(e, s) for g in self.handed_out[step] for e, s in g.delivered.items()]
            self.log.dead_letters(step, [(e, s) for e, s in pairs if s in dead])

    def ack(self) -> list:
        """The oldest batch handed out is trained (and checkpointed when due): acknowledge
        every batch a checkpoint covers, or, without checkpoints, this one (the lead; a no-op
        elsewhere), settling its ``dead_letter`` samples. Returns the trained batch's
        ``ReadyGroup``s."""
        if self.consumer is None:
            return []
        groups = self.handed_out[self._reported]
        self._reported += 1
        self.ack_covered(self._reported if self.log is None else None)
        return groups

    def ack_covered(self, through: int | None = None) -> int:
        """Acknowledge the batches of the steps before ``through`` (default: the steps the
        last checkpoint covers) not acknowledged yet. Returns how many steps."""
        if self.consumer is None:
            return 0
        if through is None:
            through = steps_checkpointed(self.log.path.parent) if self.log else self._reported
        through = min(through, self._reported)
        steps = [s for s in sorted(self.handed_out) if self._acked <= s < through]
        if steps:
            groups = [g for s in steps for g in self.handed_out[s]]
            dead = [d for s in steps for d in self.dead_letters.get(s, ())]
            # The trainer commits (checkpoints) before it settles, so a group ``settle`` says
            # is not this consumer's is trained all the same: its entry was lost in a failover
            # of the stream's master (read from the old one; found by the seeded soak, which
            # then trained the writer's repeat of it again), or a stand-by settled it first.
            # Either way it is remembered as done, so a repeat is dropped, not trained again.
            won = self.consumer.settle(groups, dead, MISSING_RECORD_REASON)
            kept = [g for g in groups if not any(g is w for w in won)]
            if kept:
                entries = [e for g in kept for e in g.entry_ids]
                samples = [s for g in kept for s in g.sample_ids]
                self.consumer.covered(entries, samples, [g.key for g in kept])
            for s in steps:
                self.dead_letters.pop(s, None)
            for s in steps:  # once acknowledged: a failed call is tried again by the next
                del self.handed_out[s]
            if self.log is not None:
                self.log.acked(steps[-1])
            self._acked = steps[-1] + 1
        return len(steps)

    def close(self) -> None:
        """Acknowledge what the last checkpoint covers (always safe: also after an error)."""
        try:
            if self.consumer is not None and self.log is not None:
                self.ack_covered()
        except Exception:  # noqa: BLE001 - the resumed job acknowledges them from the log
            log.warning("could not acknowledge the checkpointed batches", exc_info=True)
        finally:
            if self.log is not None:
                self.log.close()
            if self._own_client is not None:
                self._own_client.close()


def plan_batches(sample_ids: Sequence[str], batch_size: int, steps: int) -> list[BatchPlan]:
    """``steps`` batches of ``batch_size`` consecutive ids, cycling through ``sample_ids``."""
    if not sample_ids:
        raise ValueError("no sample ids to train on")
    ids = list(sample_ids)
    plans = []
    for step in range(steps):
        start = step * batch_size
        plans.append(BatchPlan([ids[(start + i) % len(ids)] for i in range(batch_size)]))
    return plans
