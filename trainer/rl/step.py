"""One RL step on a fetched batch, in mode disabled, R2 or R3, with its consistency report.

Order: rewards and GRPO advantages; the old-logprob pass (no gradients); a comparison pass (no
gradients, ``report.compare``) with the other routing, so every step reports the gap to the
rollout with replay and without; then ``ppo_epochs`` passes over the mini-batches, each
mini-batch a forward and backward of its micro-batches and one optimizer step. Every pass is
one call of megatron's schedule (``trainer.rl.schedule``): no pipelining, 1F1B or interleaved
1F1B, the same code on one rank and under any parallel sizes.

Which routing each pass uses (``trainer.rl.stages.PASSES``):

| mode | old-logprob pass | update passes | comparison pass |
|---|---|---|---|
| disabled | natural | natural | replays the rollout's routes |
| R2 | natural, what it chose kept | replay what the old pass chose | replays the rollout's |
| R3 | replays the rollout's routes | replay the rollout's routes | natural |

Replay ids stay this rank's ids inside a step: the rollout's records are aligned and cut to
this rank's layers and rows once; R2 keeps what each router chose in the old-logprob pass on
this rank's rows as the update passes' ids. Each stage takes what it needs and returns a small
frozen result (``trainer.rl.stages``); the report is built from them (``measure.step_report``).
Records of the routes used are built only for ``record_file`` (``trainer.rl.routes_used``). With
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

Parallelism (``dp``, a ``trainer.distributed.dp.DataParallel``, and its ``model``): each DP rank
trains its share of every mini-batch; advantages come from every rank's rewards; gradients
are summed over the ranks with the loss normalised by the mini-batch's generated-token count
over all of them.
Tensor parallel: micro-batches are padded (or packed sequences each padded) to a multiple of
the TP size and each router replays its sequence shard. Pipeline parallel: each stage's
routers replay their own layers; log-probs come from the last stage and reach every stage.
Expert parallel needs nothing: routes name global experts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from routereplay.domain.record import MASKED, Record
from trainer.config import ReplayMode, TrainerConfig
from trainer.data.source import FetchedBatch, Sample
from trainer.distributed.dp import SINGLE, DataParallel
from trainer.layout import MicroBatch, RankShare, plan_step
from trainer.model.build import TrainerModel
from trainer.optim import AdamW
from trainer.rl import counts, measure, objective
from trainer.rl.routes_used import routes_used
from trainer.rl.schedule import LastStage, PassResult, Schedule
from trainer.rl.stages import (
    PASSES,
    ByLayer,
    Comparison,
    Laid,
    OldPass,
    Routing,
    StepResult,
    Updates,
)


class RLStep:
    """Runs steps on one model (``run``: one batch, its report and the routes it used)."""

    def __init__(
        self,
        built: TrainerModel,
        optimizer: AdamW,
        config: TrainerConfig,
        dp: DataParallel = SINGLE,
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
        self.local_mini = config.train.mini_batch_size_or_micro // dp.size

    # -- the step --------------------------------------------------------------------------

    def run(self, fetched: FetchedBatch, step: int = 0) -> StepResult:
        """Train on one batch; returns the step's report (see ``docs/trainer.md``) and, with
        ``router_replay.record_file``, the routes its update passes used."""
        clock = measure.Clock()
        laid = self._layout(fetched)
        clock.lap("align")
        old = self._old_logprob_pass(laid)
        clock.lap("old_logprob")
        compared = self._comparison_pass(laid, old)
        clock.lap("compare")
        updates = self._update_epochs(laid, old)
        used = self._routes_used(laid, old)
        clock.lap("update")
        ctx = measure.StepContext(
            step, self.mode, self.passes, self.built.geometry, self.dp, self.local_mini
        )
        report = measure.step_report(ctx, fetched, laid, old, compared, updates, clock)
        return StepResult(report, used)

    def _layout(self, fetched: FetchedBatch) -> Laid:
        """Rewards and advantages; this rank's mini- and micro-batches and the rollout's routes
        as replay ids (``trainer.layout.plan_step``: replayed, or the routing agreement's
        reference) and, in R3, each micro-batch's replay reference (``replay_followed``'s)."""
        rewards, adv = self._advantages(fetched.samples)
        layout = plan_step(
            fetched.samples,
            fetched.records,
            adv,
            train=self.config.train,
            dp=self.dp,
            share=self.share,
            geometry=self.built.geometry,
            router_layers=[r.layer for r in self.built.routers],
            model_id=self.config.model.model_id or None,
            with_reference=self.mode is ReplayMode.R3,
        )
        return Laid(rewards, layout, layout.micro_batches)

    def _old_logprob_pass(self, laid: Laid) -> OldPass:
        """No gradients: the old log-probs, the sampled tokens' mass and entropy, what each
        router chose on this rank's rows (R2's replay ids; the update agreement's reference in
        disabled and R2)."""
        mbs, followed = laid.micro_batches, self._no_counts()
        if not mbs:
            return OldPass([], [], [], torch.zeros(0), torch.zeros(0), followed)

        def outputs(m, logits):
            mb = mbs[m]
            return None, {
                "logp": objective.token_logprobs(logits, mb.batch.token_ids),
                "mass": objective.target_mass(logits)[mb.generated],
                "entropy": objective.token_entropy(logits)[mb.generated],
            }

        result = self._pass(laid, outputs, self.passes.old)
        chosen = [
            {layer: torch.where(ok[:, None], seen["natural"], MASKED) for layer, seen in mb.items()}
            for mb, ok in zip(result.routes, laid.layout.replayable, strict=True)
        ]
        if self.passes.old is Routing.ROLLOUT:
            followed += self._followed(result, laid.layout.reference)
        return OldPass(
            logp=[o["logp"] for o in result.outputs],
            routes=result.routes,
            chosen=chosen,
            mass=torch.cat([o["mass"] for o in result.outputs]),
            entropy=torch.cat([o["entropy"] for o in result.outputs]),
            followed=followed,
        )

    def _comparison_pass(self, laid: Laid, old: OldPass) -> Comparison:
        """No gradients, same weights: the other routing, so the step reports the gap to the
        rollout with replay and without; then the routing agreement of the natural pass."""
        mbs, logp, natural = laid.micro_batches, None, old.routes
        if self.compare and mbs:

            def outputs(m, logits):
                return None, {"logp": objective.token_logprobs(logits, mbs[m].batch.token_ids)}

            result = self._pass(laid, outputs, self.passes.compare)
            logp = [o["logp"] for o in result.outputs]
            if self.passes.compare is Routing.NATURAL:
                natural = result.routes
        agree = self._no_counts()
        for routes, ids in zip(natural, laid.layout.replay_ids, strict=True):
            agree += self._counts(routes, self._by_layer(ids), "natural")
        return Comparison(logp, counts.world_sum(agree))

    def _update_epochs(self, laid: Laid, old: OldPass) -> Updates:
        """``ppo_epochs`` passes over the mini-batches, one optimizer step per mini-batch, with
        the update passes' routing; per epoch, how often the routers' natural choice was the
        routes used (``update_agreement``)."""
        epochs, update = self.config.train.ppo_epochs, self.passes.update
        if update is Routing.ROLLOUT:
            ids = [self._by_layer(ids) for ids in laid.layout.replay_ids]
        else:  # R2 replays what the old pass chose; disabled compares with it
            ids = old.chosen
        aux = measure.AuxLoss(self.built)
        losses, clips, drift, followed = [], [], [], self._no_counts()
        for _epoch in range(epochs):
            same_counts = self._no_counts()
            for mini, lo in zip(laid.layout.minis, self._starts(laid), strict=True):
                loss, clip, same, used = self._mini_step(laid, mini, lo, old.logp, ids)
                losses.append(loss)
                clips.append(clip)
                same_counts += same
                followed += used
            drift.append(counts.same_fraction(counts.world_sum(same_counts)))
        aux_layers = aux.read(epochs * len(laid.micro_batches), self.mp)
        norms = self.optimizer.take_grad_norms()
        # Only when every rank holds the whole model is this rank's norm the whole gradient's.
        grad_norm = norms if self.mp is None else None
        replayed = self._replayed(laid)
        return Updates(losses, clips, drift, aux_layers, replayed, followed, grad_norm)

    def _mini_step(
        self,
        laid: Laid,
        mini: list[MicroBatch],
        lo: int,
        old_logp: list[torch.Tensor],
        ids: list[ByLayer],
    ) -> tuple[float, float, np.ndarray, np.ndarray]:
        """One mini-batch's forward, backward and optimizer step: its loss and clip fraction,
        and the counts of its routers' natural choice (and, replaying the rollout's routes,
        of the experts used) against the routes used."""
        self.optimizer.zero_grad()
        tokens = int(self.dp.sum([sum(int(mb.generated.sum()) for mb in mini)])[0])
        loss = clip = 0.0  # no samples here: zero gradients into the sums
        same, used = self._no_counts(), self._no_counts()
        if mini:
            result = self._update(mini, lo, old_logp, ids, tokens)
            loss = sum(float(o["loss"]) for o in result.outputs)
            clip = sum(float(o["clip"]) for o in result.outputs)
            for m, routes in enumerate(result.routes):
                same += self._counts(routes, ids[lo + m], "natural")
            if self.passes.update is Routing.ROLLOUT:
                used = self._followed(result, laid.layout.reference[lo : lo + len(mini)])
        self.dp.reduce_gradients(self.built.model)
        self.optimizer.step()
        return loss, clip, same, used

    def _update(
        self,
        mini: list[MicroBatch],
        lo: int,
        old_logp: list[torch.Tensor],
        update_ids: list[ByLayer],
        tokens: int,
    ) -> PassResult:
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
        if self.passes.update is not Routing.NATURAL:
            routers = self.built.routers
            replay = [[update_ids[lo + m][r.layer] for r in routers] for m in range(len(mini))]
        return self.schedule.run(
            [mb.batch for mb in mini], loss, replay=replay, forward_only=False, observe=True
        )

    def _pass(self, laid: Laid, last_stage: LastStage, routing: Routing) -> PassResult:
        """A pass without gradients, replaying the rollout's routes or routing naturally."""
        replay = laid.layout.replay_ids if routing is Routing.ROLLOUT else None
        return self.schedule.run(laid.batches, last_stage, replay=replay, observe=True)

    def _routes_used(self, laid: Laid, old: OldPass) -> list[Record]:
        if not self.config.router_replay.record_file:
            return []
        return routes_used(
            laid.micro_batches,
            old,
            rollout=self.passes.update is Routing.ROLLOUT,
            geometry=self.built.geometry,
            dp=self.dp,
            local_mini=self.local_mini,
        )

    # -- rows, counts and advantages -------------------------------------------------------

    def _replayed(self, laid: Laid) -> int:
        """Rows the update passes replayed: the rollout's routed rows, or in R2 every token
        but each sample's last (each has a route of the old pass)."""
        if self.passes.update is Routing.NATURAL:
            return 0
        if self.passes.update is Routing.ROLLOUT:
            return sum(laid.layout.replayed)
        return sum(int(b.lengths.sum()) - b.batch_size for b in laid.batches)

    @staticmethod
    def _starts(laid: Laid) -> list[int]:
        """Each mini-batch's first micro-batch in ``micro_batches`` (where its ids are)."""
        return [0, *itertools.accumulate(len(mini) for mini in laid.layout.minis)][:-1]

    def _followed(self, result: PassResult, recorded: list[ByLayer]) -> np.ndarray:
        """``count_same`` of what the routing maps used in a replayed pass (each forward, and
        each forward recomputed in backward) against the records' routes."""
        out = self._no_counts()
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

    def _by_layer(self, ids: list[torch.Tensor]) -> ByLayer:
        return {r.layer: i for r, i in zip(self.built.routers, ids, strict=True)}

    def _counts(self, routes: dict, reference: ByLayer, key: str) -> np.ndarray:
        return counts.count_same(routes, reference, key, self.columns)

    def _no_counts(self) -> np.ndarray:
        return counts.no_counts(len(self.columns))

    def _advantages(self, samples: Sequence[Sample]) -> tuple[list[float], np.ndarray]:
        """Rewards of the whole batch (in the single-rank order) and this rank's advantages,
        normalised within each GRPO group over every DP rank's samples."""
        rewards = [objective.reward(s) for s in samples]
        groups = [s.group_id for s in samples]
        if not self.dp.enabled:
            return rewards, objective.group_advantages(rewards, groups)
        mark = self.dp.rank
        per_sample = {j: (mark, r, g) for j, (r, g) in enumerate(zip(rewards, groups, strict=True))}
        entries = measure.in_batch_order(self.dp, self.local_mini, per_sample)
        adv = objective.group_advantages([e[1] for e in entries], [e[2] for e in entries])
        mine = np.array([a for e, a in zip(entries, adv, strict=True) if e[0] == mark])
        return [e[1] for e in entries], mine.astype(np.float32)
