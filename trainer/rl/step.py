"""One RL step on a fetched batch, in mode disabled, R2 or R3, with its consistency report.

Order: rewards and GRPO advantages; the old-logprob pass (no gradients); a comparison pass (no
gradients, ``report.compare``) with the other routing, so every step reports the gap to the
rollout with replay and without; then ``ppo_epochs`` passes over the mini-batches, each
mini-batch a forward and backward of its micro-batches and one optimizer step. Every pass is
one call of megatron's schedule (``trainer.rl.schedule``): no pipelining, 1F1B or interleaved
1F1B, the same code on one rank and on any layout.

Which routing each pass uses (``PASSES``):

| mode | old-logprob pass | update passes | comparison pass |
|---|---|---|---|
| disabled | natural | natural | replays the rollout's routes |
| R2 | natural, what it chose kept | replay what the old pass chose | replays the rollout's |
| R3 | replays the rollout's routes | replay the rollout's routes | natural |

Replay ids stay this rank's ids inside a step: the rollout's records are aligned and cut to
this rank's layers and rows once; R2 keeps what each router chose in the old-logprob pass on
this rank's rows as the update passes' ids. Records are built only for ``record_file``. With
stage reads (``trainer.data.stage_reads``) a rank's records hold only its stage's layers;
``record_file`` gets them whole, gathered over the pipeline stages. ``route_bytes`` in the
report: what the ranks read from the route cache against the batch's whole records' bytes.

Routing agreement is measured on the natural pass (the old-logprob pass in disabled and R2,
the comparison pass in R3; without a comparison pass in R3, megatron's natural top-k in the
replayed pass). In each update pass, the routers' natural top-k is compared with the routes
of the old-logprob pass (``update_agreement``): with replay the routes used stay those,
whatever the optimizer did to the routers; ``disabled`` follows the drift. R3 also checks
that replay happened: the experts each router's routing map sent a token to are compared with
the record's row of that token, in every replayed pass (old log-probs, updates, recomputes in
backward): ``replay_followed``. The record's row is found from the model's own inputs (sample
and position id of each token, cut as megatron cuts the embeddings), not from the replay ids,
so an alignment or resharding fault lowers it.
Counts are taken where the routers run, on each rank's rows and layers, and summed over every
rank: each (row, layer) lives on exactly one rank of a data-parallel rank's model group.

Layouts (``dp``, a ``trainer.parallel.dp.DataParallel``, and its ``model``): each DP rank trains its
share of every mini-batch; advantages come from every rank's rewards; gradients are summed over
the ranks with the loss normalised by the mini-batch's generated-token count over all of them.
Tensor parallel: micro-batches are padded (or packed sequences each padded) to a multiple of
the TP size and each router replays its sequence shard. Pipeline parallel: each stage's
routers replay their own layers; log-probs come from the last stage and reach every stage.
Expert parallel needs nothing: routes name global experts.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from routereplay.domain.record import MASKED, Record, Turn
from trainer.config import ReplayMode, TrainerConfig
from trainer.data.source import FetchedBatch
from trainer.layout import MicroBatch, RankShare, StepLayout, plan_step
from trainer.layout.align import routes_from_recorded
from trainer.layout.batch import PaddedBatch
from trainer.model.build import TrainerModel
from trainer.parallel.dp import SINGLE, DataParallel
from trainer.report.step_report import Gap, RouteBytes, Rows, StepReport, Times
from trainer.rl import measure, metrics, objective
from trainer.rl.schedule import Schedule


class Routing(enum.Enum):
    """What a pass's routers use."""

    NATURAL = "natural"
    ROLLOUT = "rollout"  # the rollout's routes, replayed
    RECORDED = "recorded"  # what the old-logprob pass chose, replayed


@dataclass(frozen=True)
class Passes:
    old: Routing
    update: Routing
    compare: Routing


PASSES = {
    ReplayMode.DISABLED: Passes(Routing.NATURAL, Routing.NATURAL, Routing.ROLLOUT),
    ReplayMode.R2: Passes(Routing.NATURAL, Routing.RECORDED, Routing.ROLLOUT),
    ReplayMode.R3: Passes(Routing.ROLLOUT, Routing.ROLLOUT, Routing.NATURAL),
}
GAP_NAMES = {Routing.NATURAL: "natural", Routing.ROLLOUT: "replayed"}


@dataclass
class _Work:
    """One step's state, handed from stage to stage of ``RLStep.run``."""

    fetched: FetchedBatch
    rewards: list[float] = field(default_factory=list)
    minis: list[list[MicroBatch]] = field(default_factory=list)
    mbs: list[MicroBatch] = field(default_factory=list)
    rollout: list = field(default_factory=list)  # per micro-batch: (replay ids, replayed rows)
    replayable: list[torch.Tensor] = field(default_factory=list)  # this rank's rows with a route
    recorded: list = field(default_factory=list)  # R3: per micro-batch, the record routes
    old: object = None  # the old-logprob pass's result
    old_logp: list[torch.Tensor] = field(default_factory=list)
    other_logp: list[torch.Tensor] | None = None
    chosen: list = field(default_factory=list)
    natural_routes: list = field(default_factory=list)
    followed: np.ndarray | None = None
    agree: np.ndarray | None = None
    replayed: int = 0
    losses: list[float] = field(default_factory=list)
    clips: list[float] = field(default_factory=list)
    drift: list[float] = field(default_factory=list)
    aux_layers: list[float] | None = None
    times: dict[str, float] = field(default_factory=dict)
    _clock: float = field(default_factory=time.perf_counter)

    @property
    def samples(self):
        return self.fetched.samples

    @property
    def batches(self):
        return [mb.batch for mb in self.mbs]

    def lap(self, name: str) -> None:
        """Charge the time since the last lap to stage ``name``."""
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self._clock
        self._clock = now


class RLStep:
    """Runs steps on one model. ``routes_used`` holds, after each step with
    ``router_replay.record_file`` set, the records of the routes its update passes used (R3:
    the rollout's; R2: recorded; disabled: the natural routes of the old-logprob pass)."""

    def __init__(
        self, built: TrainerModel, optimizer, config: TrainerConfig, dp: DataParallel = SINGLE
    ):
        if built.replay is None:
            raise ValueError("the RL step needs a model built with routing_replay=True")
        self.built = built
        self.dp = dp
        self.mp = dp.model
        self.share = RankShare(self.mp)
        self.optimizer = optimizer
        self.config = config
        self.mode = config.router_replay.mode
        self.passes = PASSES[self.mode]
        self.compare = config.report.compare
        self.schedule = Schedule(
            built,
            self.mp.tp_group if self.mp is not None else None,
            self.mp.pp_group if self.mp is not None else None,
        )
        self.columns = {layer: j for j, layer in enumerate(built.geometry.moe_layers)}
        self.routes_used: list[Record] = []

    # -- layout ----------------------------------------------------------------------------

    def _plan(self, samples, records, adv) -> StepLayout:
        """This rank's micro-batches and replay ids (``trainer.layout.plan_step``)."""
        return plan_step(
            samples,
            records,
            adv,
            train=self.config.train,
            dp=self.dp,
            share=self.share,
            geometry=self.built.geometry,
            router_layers=[r.layer for r in self.built.routers],
            model_id=self.config.model.model_id or None,
        )

    def _recorded(self, mb: MicroBatch) -> dict[int, torch.Tensor]:
        """Per router of this rank, the record's route of each of its rows (``MASKED``: none)."""
        layers = [r.layer for r in self.built.routers]
        return metrics.recorded_routes(mb.batch, mb.records, layers, self.share.megatron_share)

    def _followed(self, result, recorded: list[dict[int, torch.Tensor]]) -> np.ndarray:
        """``_counts`` of what the routing maps used in a replayed pass (each forward, and
        each forward recomputed in backward) against the records' routes."""
        out = np.zeros((len(self.columns), 3), np.int64)
        for routes, reference in zip(result.routes, recorded, strict=True):
            out += self._counts(routes, reference, "used")
        for layer, calls in result.recomputed.items():
            if not calls:  # no activation recompute
                continue
            if len(calls) != len(recorded):
                raise RuntimeError(
                    f"layer {layer}: {len(calls)} recomputed router calls for "
                    f"{len(recorded)} micro-batches"
                )
            for used, reference in zip(calls, recorded, strict=True):
                out += self._counts({layer: {"used": used}}, {layer: reference[layer]}, "used")
        return out

    def _by_layer(self, ids: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        return {r.layer: i for r, i in zip(self.built.routers, ids, strict=True)}

    def _counts(self, routes: dict, reference: dict[int, torch.Tensor], key: str) -> np.ndarray:
        return measure.count_same(routes, reference, key, self.columns)

    def _no_counts(self) -> np.ndarray:
        return np.zeros((len(self.columns), 3), np.int64)

    # -- the step --------------------------------------------------------------------------

    def run(self, fetched: FetchedBatch, step: int = 0) -> StepReport:
        """Train on one batch; returns the step's report (see ``docs/trainer.md``)."""
        work = _Work(fetched)
        self._layout(work)
        work.lap("align")
        self._old_logprob_pass(work)
        work.lap("old_logprob")
        self._comparison_pass(work)
        work.lap("compare")
        self._update_epochs(work)
        work.lap("update")
        return self._report(work, step)

    def _layout(self, work: _Work) -> None:
        """Rewards and advantages; this rank's mini- and micro-batches; the rollout's routes
        as replay ids (replayed, or the routing agreement's reference) and, in R3, each router
        row's record route (``replay_followed``'s reference, found from the model's inputs and
        not from the replay ids, so a wrong alignment or cut shows)."""
        cfg, dp = self.config.train, self.dp
        work.rewards, adv = self._advantages(work.samples, cfg.mini_batch_size_or_micro // dp.size)
        laid = self._plan(work.samples, work.fetched.records, adv)
        work.minis, work.mbs = laid.minis, laid.micro_batches
        work.rollout = list(zip(laid.replay_ids, laid.replayed, strict=True))
        work.replayable = laid.replayable
        if self.mode is ReplayMode.R3:
            work.recorded = [self._recorded(mb) for mb in work.mbs]
        work.followed = self._no_counts()

    def _old_logprob_pass(self, work: _Work) -> None:
        """No gradients: the old log-probs, the sampled tokens' mass and entropy, what each
        router chose on this rank's rows (R2's replay ids; the update agreement's reference in
        disabled and R2)."""
        mbs = work.mbs
        if not mbs:
            return

        def outputs(m, logits):
            mb = mbs[m]
            return None, {
                "logp": objective.token_logprobs(logits, mb.batch.token_ids),
                "mass": objective.target_mass(logits)[mb.generated],
                "entropy": objective.token_entropy(logits)[mb.generated],
            }

        old = self._pass(work.batches, outputs, self.passes.old, work.rollout, None)
        work.old = old
        work.old_logp = [o["logp"] for o in old.outputs]
        work.natural_routes = old.routes
        work.chosen = [
            {layer: torch.where(ok[:, None], seen["natural"], MASKED) for layer, seen in mb.items()}
            for mb, ok in zip(old.routes, work.replayable, strict=True)
        ]
        if self.passes.old is Routing.ROLLOUT:
            work.followed += self._followed(old, work.recorded)

    def _comparison_pass(self, work: _Work) -> None:
        """No gradients, same weights: the other routing, so the step reports the gap to the
        rollout with replay and without; then the routing agreement of the natural pass."""
        mbs = work.mbs
        if self.compare and mbs:
            result = self._pass(
                work.batches,
                lambda m, logits: (
                    None,
                    {"logp": objective.token_logprobs(logits, mbs[m].batch.token_ids)},
                ),
                self.passes.compare,
                work.rollout,
                None,
            )
            work.other_logp = [o["logp"] for o in result.outputs]
            if self.passes.compare is Routing.NATURAL:
                work.natural_routes = result.routes
        agree = self._no_counts()
        for routes, (ids, _) in zip(work.natural_routes, work.rollout, strict=True):
            agree += self._counts(routes, self._by_layer(ids), "natural")
        work.agree = measure.world_sum(agree)

    def _update_epochs(self, work: _Work) -> None:
        """``ppo_epochs`` passes over the mini-batches, one optimizer step per mini-batch, with
        the update passes' routing; per epoch, how often the routers' natural choice was the
        routes used (``update_agreement``)."""
        cfg, dp, passes, mbs = self.config.train, self.dp, self.passes, work.mbs
        if passes.update is Routing.ROLLOUT:
            update_ids = [self._by_layer(ids) for ids, _ in work.rollout]
            work.replayed = sum(n for _, n in work.rollout)
        else:  # every token but each sample's last has a route
            update_ids = work.chosen
            work.replayed = sum(int(b.lengths.sum()) - b.batch_size for b in work.batches)
        if self.config.router_replay.record_file:
            routes = work.old.routes if work.old else []
            self.routes_used = self._routes_used(mbs, routes, work.old_logp)
        aux = measure.AuxLoss(self.built)
        replay_update = passes.update is not Routing.NATURAL
        # Each mini-batch's first micro-batch in ``mbs`` (old log-probs and ids are kept there).
        starts = [0, *itertools.accumulate(len(mini) for mini in work.minis)][:-1]
        for _epoch in range(cfg.ppo_epochs):
            counts = self._no_counts()
            for mini, lo in zip(work.minis, starts, strict=True):
                self.optimizer.zero_grad()
                tokens = int(dp.sum([sum(int(mb.generated.sum()) for mb in mini)])[0])
                loss = clip = 0.0  # no samples here: zero gradients into the sums
                if mini:
                    result = self._update(
                        mini, lo, work.old_logp, update_ids, replay_update, tokens
                    )
                    loss = sum(float(o["loss"]) for o in result.outputs)
                    clip = sum(float(o["clip"]) for o in result.outputs)
                    for m, routes in enumerate(result.routes):
                        counts += self._counts(routes, update_ids[lo + m], "natural")
                    if passes.update is Routing.ROLLOUT:
                        work.followed += self._followed(result, work.recorded[lo : lo + len(mini)])
                work.losses.append(loss)
                work.clips.append(clip)
                dp.reduce_gradients(self.built.model)
                self.optimizer.step()
            work.drift.append(measure.same_fraction(measure.world_sum(counts)))
        work.aux_layers = aux.read(cfg.ppo_epochs * len(mbs), self.mp)
        if not replay_update:
            work.replayed = 0

    def _report(self, work: _Work, step: int) -> StepReport:
        """The step's figures, summed or maxed over every rank."""
        dp, fetched, geometry = self.dp, work.fetched, self.built.geometry
        losses, clips, aux_layers = work.losses, work.clips, work.aux_layers
        if dp.enabled:
            losses = dp.sum(losses).tolist()
            clips = dp.sum(clips).tolist()
            if aux_layers is not None:
                aux_layers = (dp.sum(aux_layers) / dp.size).tolist()
        outputs = work.old.outputs if work.old else []
        masses = torch.cat([o["mass"] for o in outputs]) if outputs else torch.zeros(0)
        entropy = torch.cat([o["entropy"] for o in outputs]) if outputs else torch.zeros(0)
        totals = measure.StepTotals(
            valid_rows=sum(int(b.valid.sum()) for b in work.batches),
            replayed_rows=work.replayed,
            mass_sum=float(masses.double().sum()),
            mass_tokens=masses.numel(),
            entropy_sum=float(entropy.double().sum()),
            samples=len(work.samples),
            missing=len(fetched.missing),
            dropped=len(fetched.dropped),
            stored_route_bytes=sum(
                r.num_rows * r.geometry.row_bytes for r in fetched.records if r is not None
            ),
        ).summed(dp)
        # Each rank counts what it read itself (one rank per TP/CP group with stage reads).
        read = int(measure.world_sum(np.array([fetched.route_bytes], np.int64))[0])
        valid, replayed, stored = (
            int(totals.valid_rows),
            int(totals.replayed_rows),
            int(totals.stored_route_bytes),
        )
        time_s = {"fetch": fetched.fetch_s, "fetch_wait": fetched.wait_s, **work.times}
        if dp.enabled:  # the slowest rank's time (the step waits for it)
            time_s = {k: max(t[k] for t in dp.all_gather(time_s)) for k in time_s}
        mass_n = totals.mass_tokens
        layers = list(geometry.moe_layers)
        return StepReport(
            step=step,
            mode=self.mode.value,
            samples=int(totals.samples),
            reward_mean=float(np.mean(work.rewards)) if work.rewards else 0.0,
            expected_reward=totals.mass_sum / mass_n if mass_n else 0.0,
            entropy=totals.entropy_sum / mass_n if mass_n else 0.0,
            loss=float(np.mean(losses)),
            clip_fraction=float(np.mean(clips)),
            update_agreement=work.drift,
            rows=Rows(
                valid=valid,
                replayed=replayed,
                replayed_fraction=replayed / max(valid, 1),
                masked_fraction=(
                    1 - replayed / max(valid, 1)
                    if self.passes.update is not Routing.NATURAL
                    else 0.0
                ),
            ),
            missing_records=int(totals.missing),
            dropped_samples=int(totals.dropped),
            route_bytes=RouteBytes(read, stored, read / stored if stored else 0.0),
            time_s=Times(**time_s),
            gap=self._gaps(work.mbs, work.old_logp, work.other_logp),
            agreement=measure.agreement(work.agree, layers, geometry.topk),
            replay_followed=(
                measure.replay_followed(measure.world_sum(work.followed), layers)
                if self.mode is ReplayMode.R3
                else None
            ),
            aux_loss=float(np.mean(aux_layers)) if aux_layers else None,
            aux_loss_layers=aux_layers,
        )

    def _pass(self, batches, last_stage, routing: Routing, rollout, chosen, **kwargs):
        replay = None
        if routing is Routing.ROLLOUT:
            replay = [ids for ids, _ in rollout]
        elif routing is Routing.RECORDED:
            replay = [[ids[r.layer] for r in self.built.routers] for ids in chosen]
        return self.schedule.run(batches, last_stage, replay=replay, observe=True, **kwargs)

    def _update(self, mini, lo, old_logp, update_ids, replay_update, tokens):
        """One mini-batch's forward and backward (gradients left in the parameters)."""
        cfg = self.config.train

        def loss(m, logits):
            mb = mini[m]
            logp = objective.token_logprobs(logits, mb.batch.token_ids)
            value, clip = objective.ppo_loss(
                logp, old_logp[lo + m], mb.advantages, mb.generated, cfg.clip_eps, tokens
            )
            return value, {"loss": value.detach(), "clip": clip}

        replay = None
        if replay_update:
            replay = [
                [update_ids[lo + m][r.layer] for r in self.built.routers] for m in range(len(mini))
            ]
        return self.schedule.run(
            [mb.batch for mb in mini], loss, replay=replay, forward_only=False, observe=True
        )

    # -- data parallel and the report ------------------------------------------------------

    def _advantages(self, samples, local_mini: int) -> tuple[list[float], np.ndarray]:
        """Rewards of the whole batch (in the single-rank order) and this rank's advantages,
        normalised within each GRPO group over every DP rank's samples."""
        rewards = [objective.reward(s) for s in samples]
        groups = [s.group_id for s in samples]
        if not self.dp.enabled:
            return rewards, objective.group_advantages(rewards, groups)
        rank = self.dp.rank
        entries = sorted(
            (j // local_mini, r, j, reward, group)
            for r, part in enumerate(self.dp.all_gather(list(zip(rewards, groups, strict=True))))
            for j, (reward, group) in enumerate(part)
        )
        adv = objective.group_advantages([e[3] for e in entries], [e[4] for e in entries])
        mine = np.array([a for e, a in zip(entries, adv, strict=True) if e[1] == rank])
        return [e[3] for e in entries], mine.astype(np.float32)

    def _in_batch_order(self, per_sample: dict[int, object]) -> list:
        """Per-sample items of every DP rank (keyed by their local batch position), in the
        single-rank order: mini-batch, then DP rank, then position."""
        local_mini = self.config.train.mini_batch_size_or_micro // self.dp.size
        parts = self.dp.all_gather(per_sample)
        keyed = sorted(
            ((j // local_mini, r, j), item)
            for r, part in enumerate(parts)
            for j, item in part.items()
        )
        return [item for _, item in keyed]

    def _gaps(self, mbs, old_logp, other_logp) -> dict[str, Gap]:
        """Gap to the rollout per routing, over every DP rank's generated tokens."""
        gap = {}
        for key, per_mb, routing in (
            ("old_logprob", old_logp, self.passes.old),
            ("compare", other_logp, self.passes.compare),
        ):
            if per_mb is None:
                continue
            per_sample = {}
            for mb, lp in zip(mbs, per_mb, strict=True):
                sel = mb.generated & ~torch.isnan(mb.rollout_logp)
                for j, s, r, ok in zip(
                    mb.index,
                    mb.per_sample(lp),
                    mb.per_sample(mb.rollout_logp),
                    mb.per_sample(sel),
                    strict=True,
                ):
                    per_sample[j] = (s[ok].numpy(), r[ok].numpy())
            pairs = self._in_batch_order(per_sample)
            trainer = np.concatenate([p[0] for p in pairs]) if pairs else np.zeros(0)
            rollout = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0)
            name = GAP_NAMES[Routing.NATURAL if routing is not Routing.ROLLOUT else routing]
            gap[name] = Gap(**metrics.logprob_gap(trainer, rollout).as_dict(), pass_=key)
        return gap

    def _routes_used(self, mbs, chosen_routes, old_logp) -> list[Record]:
        """The routes the update passes use, as layout-free records of every DP rank in the
        single-rank order (R3: the rollout's; else what the old-logprob pass chose, gathered
        over the TP ranks' rows and the pipeline stages' layers)."""
        per_sample = {}
        for m, mb in enumerate(mbs):
            if self.passes.update is Routing.ROLLOUT:
                for j, rec in zip(mb.index, self._whole_records(mb.records), strict=True):
                    if rec is not None:
                        per_sample[j] = rec
                continue
            whole = self._whole_routes(mb.batch, chosen_routes[m])
            routes = routes_from_recorded(mb.batch, whole, self.built.geometry)
            for b, (j, sample) in enumerate(zip(mb.index, mb.samples, strict=True)):
                lp = mb.batch.sample_values(old_logp[m], b).numpy()
                per_sample[j] = self._record(sample, mb.records[b], routes[b], lp)
        return self._in_batch_order(per_sample)

    def _whole_routes(self, batch: PaddedBatch, routes: dict) -> list[torch.Tensor]:
        """Per MoE layer of the model, the micro-batch's chosen ids on every row."""
        mine = {}
        for layer, seen in routes.items():
            ids = seen["natural"]
            if self.mp is not None and self.mp.tp > 1:
                parts = [torch.empty_like(ids) for _ in range(self.mp.tp)]
                dist.all_gather(parts, ids.contiguous(), group=self.mp.tp_group)
                ids = torch.cat(parts)
            mine[layer] = ids
        if self.mp is not None and self.mp.pp_group is not None and self.mp.pp_group.size() > 1:
            stages = [None] * self.mp.pp_group.size()
            dist.all_gather_object(stages, mine, group=self.mp.pp_group)
            mine = {layer: ids for stage in stages for layer, ids in stage.items()}
        return [mine[layer] for layer in self.built.geometry.moe_layers]

    def _whole_records(self, records: list[Record | None]) -> list[Record | None]:
        """The rollout's records with every MoE layer: stage reads hold each stage's layers
        (``trainer.data.stage_reads``), gathered here over the pipeline stages."""
        group = self.mp.pp_group if self.mp is not None else None
        selected = any(r is not None and r.layers is not None for r in records)
        # Every stage reads the same way: all take part in the gather or none does.
        if group is None or group.size() == 1 or not selected:
            return records
        parts = [None if r is None else (r.layers, r.routes) for r in records]
        stages = [None] * group.size()
        dist.all_gather_object(stages, parts, group=group)
        out = []
        for b, record in enumerate(records):
            if record is None or record.layers is None:
                out.append(record)
                continue
            g = record.geometry
            routes = np.empty((record.num_rows, g.num_moe_layers, g.topk), record.routes.dtype)
            for layers, part in (stage[b] for stage in stages):
                routes[:, list(layers)] = part
            out.append(dataclasses.replace(record, routes=routes, layers=None))
        return out

    def _record(self, sample, rollout: Record | None, routes: np.ndarray, lp) -> Record:
        """A sample's routes as a record (the rollout's turns, the trainer's log-probs)."""
        if rollout is not None:
            spans = [
                (t.token_start, t.token_end, t.generated_start, t.policy_version)
                for t in rollout.turns
            ]
        else:
            first = np.flatnonzero(sample.generated)
            gen = int(first[0]) if first.size else sample.token_ids.size
            spans = [(0, sample.token_ids.size, gen, 0)]
        turns = [Turn(s, e, g, v, lp[g:e].astype(np.float32)) for s, e, g, v in spans]
        return Record(
            sample.sample_id, self.built.geometry, sample.token_ids, routes, turns, sample.group_id
        )
