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
from collections import defaultdict
from dataclasses import dataclass

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
from trainer.rl import metrics, objective
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

    def _plan(self, samples, records, adv) -> StepLayout:
        """This rank's micro-batches and replay ids (``trainer.layout.plan_step``)."""
        return plan_step(
            samples, records, adv, train=self.config.train, dp=self.dp, share=self.share,
            geometry=self.built.geometry, router_layers=[r.layer for r in self.built.routers],
            model_id=self.config.model.model_id or None,
        )  # fmt: skip

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

    # -- counts ----------------------------------------------------------------------------

    def _counts(self, routes: dict, reference: dict[int, torch.Tensor], key: str) -> np.ndarray:
        """int64 ``[moe layers, 3]``: per layer, rows whose ``key`` top-k set equals the
        reference's, the experts both share summed over rows, and the rows compared (rows
        ``MASKED`` in the reference skipped), over this rank's rows and routers."""
        out = np.zeros((len(self.columns), 3), np.int64)
        for layer, ref in reference.items():
            got = routes[layer][key]
            rows = ref[:, 0] >= 0
            a, b = got[rows].sort(-1).values, ref[rows].sort(-1).values
            shared = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1)
            out[self.columns[layer]] = (
                int((a == b).all(-1).sum()),
                int(shared.sum()),
                int(rows.sum()),
            )
        return out

    @staticmethod
    def _world_sum(counts: np.ndarray) -> np.ndarray:
        """Summed over every rank (each row and layer is counted by one rank)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            total = torch.from_numpy(counts)
            dist.all_reduce(total)
            return total.numpy()
        return counts

    def _by_layer(self, ids: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        return {r.layer: i for r, i in zip(self.built.routers, ids, strict=True)}

    # -- the step --------------------------------------------------------------------------

    def run(self, fetched: FetchedBatch, step: int = 0) -> dict:
        """Train on one batch; returns the step's report (see ``docs/trainer.md``)."""
        cfg, passes, dp = self.config.train, self.passes, self.dp
        times: dict[str, float] = defaultdict(float)
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            times[name] += now - clock
            clock = now

        samples = fetched.samples
        local_mini = cfg.mini_batch_size_or_micro // dp.size
        rewards, adv = self._advantages(samples, local_mini)
        laid = self._plan(samples, fetched.records, adv)
        minis, mbs = laid.minis, laid.micro_batches
        batches = [mb.batch for mb in mbs]
        # The rollout's routes: replayed, or the reference of the routing agreement.
        rollout = list(zip(laid.replay_ids, laid.replayed, strict=True))
        # replay_followed's reference: each router row's record route, found from the model's
        # inputs (not from the replay ids above), so a wrong alignment or cut shows.
        recorded = [self._recorded(mb) for mb in mbs] if self.mode is ReplayMode.R3 else []
        lap("align")

        # Old-logprob pass.
        def old_outputs(m, logits):
            mb = mbs[m]
            return None, {
                "logp": objective.token_logprobs(logits, mb.batch.token_ids),
                "mass": objective.target_mass(logits)[mb.generated],
                "entropy": objective.token_entropy(logits)[mb.generated],
            }

        old = self._pass(batches, old_outputs, passes.old, rollout, None) if mbs else None
        old_logp = [o["logp"] for o in old.outputs] if old else []
        replayable = laid.replayable
        # What the routers chose on this rank's rows (R2's replay ids; the update agreement's
        # reference in disabled and R2).
        chosen = [
            {layer: torch.where(ok[:, None], seen["natural"], MASKED) for layer, seen in mb.items()}
            for mb, ok in zip(old.routes, replayable, strict=True)
        ] if old else []  # fmt: skip
        followed = np.zeros((len(self.columns), 3), np.int64)
        natural_routes = old.routes if old else []
        if passes.old is Routing.ROLLOUT and old:
            followed += self._followed(old, recorded)
        lap("old_logprob")

        # Comparison pass: the other routing, same weights, same step.
        other_logp = None
        if self.compare and mbs:
            result = self._pass(
                batches, lambda m, logits: (None, {"logp": objective.token_logprobs(
                    logits, mbs[m].batch.token_ids)}),
                passes.compare, rollout, None,
            )  # fmt: skip
            other_logp = [o["logp"] for o in result.outputs]
            if passes.compare is Routing.NATURAL:
                natural_routes = result.routes
        lap("compare")

        agree = np.zeros((len(self.columns), 3), np.int64)
        for routes, (ids, _) in zip(natural_routes, rollout, strict=True):
            agree += self._counts(routes, self._by_layer(ids), "natural")
        agree = self._world_sum(agree)
        if passes.update is Routing.ROLLOUT:
            update_ids = [self._by_layer(ids) for ids, _ in rollout]
            replayed = sum(n for _, n in rollout)
        else:  # every token but each sample's last has a route
            update_ids = chosen
            replayed = sum(int(b.lengths.sum()) - b.batch_size for b in batches)
        if self.config.router_replay.record_file:
            self.routes_used = self._routes_used(mbs, old.routes if old else [], old_logp)

        # Update passes: one optimizer step per mini-batch.
        aux = _AuxLoss(self.built)
        losses, clips, drift = [], [], []
        replay_update = passes.update is not Routing.NATURAL
        # Each mini-batch's first micro-batch in ``mbs`` (old log-probs and ids are kept there).
        starts = [0, *itertools.accumulate(len(mini) for mini in minis)][:-1]
        for _epoch in range(cfg.ppo_epochs):
            counts = np.zeros((len(self.columns), 3), np.int64)
            for mini, lo in zip(minis, starts, strict=True):
                self.optimizer.zero_grad()
                tokens = int(dp.sum([sum(int(mb.generated.sum()) for mb in mini)])[0])
                if mini:
                    result = self._update(mini, lo, old_logp, update_ids, replay_update, tokens)
                    losses.append(sum(float(o["loss"]) for o in result.outputs))
                    clips.append(sum(float(o["clip"]) for o in result.outputs))
                    for m, routes in enumerate(result.routes):
                        counts += self._counts(routes, update_ids[lo + m], "natural")
                    if passes.update is Routing.ROLLOUT:
                        followed += self._followed(result, recorded[lo : lo + len(mini)])
                else:  # no samples here: zero gradients into the sums
                    losses.append(0.0)
                    clips.append(0.0)
                dp.reduce_gradients(self.built.model)
                self.optimizer.step()
            drift.append(_same_fraction(self._world_sum(counts)))
        lap("update")
        aux_layers = aux.read(cfg.ppo_epochs * len(mbs), self.mp)
        if dp.enabled:
            losses = dp.sum(losses).tolist()
            clips = dp.sum(clips).tolist()
            if aux_layers is not None:
                aux_layers = (dp.sum(aux_layers) / dp.size).tolist()

        masses = torch.cat([o["mass"] for o in old.outputs]) if old else torch.zeros(0)
        entropy = torch.cat([o["entropy"] for o in old.outputs]) if old else torch.zeros(0)
        totals = dp.sum([
            sum(int(b.valid.sum()) for b in batches),
            replayed if replay_update else 0,
            float(masses.double().sum()), masses.numel(),
            float(entropy.double().sum()),
            len(samples), len(fetched.missing), len(fetched.dropped),
            sum(r.num_rows * r.geometry.row_bytes for r in fetched.records if r is not None),
        ]).tolist()  # fmt: skip
        valid, replayed, mass_sum, mass_n, ent_sum, n_samples, missing, dropped, stored = totals
        # Each rank counts what it read itself (one rank per TP/CP group with stage reads).
        read = int(self._world_sum(np.array([fetched.route_bytes], np.int64))[0])
        valid, replayed = int(valid), int(replayed)
        time_s = {"fetch": fetched.fetch_s, "fetch_wait": fetched.wait_s, **times}
        if dp.enabled:  # the slowest rank's time (the step waits for it)
            time_s = {k: max(t[k] for t in dp.all_gather(time_s)) for k in time_s}
        report = {
            "gap": self._gaps(mbs, minis, old_logp, other_logp),
            "agreement": self._agreement(agree),
        }
        if self.mode is ReplayMode.R3:
            report["replay_followed"] = self._replay_followed(self._world_sum(followed))
        report.update(
            step=step,
            mode=self.mode.value,
            samples=int(n_samples),
            reward_mean=float(np.mean(rewards)) if rewards else 0.0,
            expected_reward=mass_sum / mass_n if mass_n else 0.0,
            entropy=ent_sum / mass_n if mass_n else 0.0,
            loss=float(np.mean(losses)),
            clip_fraction=float(np.mean(clips)),
            update_agreement=drift,
            rows={
                "valid": valid,
                "replayed": replayed,
                "replayed_fraction": replayed / max(valid, 1),
                "masked_fraction": 1 - replayed / max(valid, 1) if replay_update else 0.0,
            },
            missing_records=int(missing),
            aux_loss=float(np.mean(aux_layers)) if aux_layers else None,
            aux_loss_layers=aux_layers,
            dropped_samples=int(dropped),
            route_bytes={
                "read": read,
                "batch": int(stored),
                "read_per_batch": read / stored if stored else 0.0,
            },
            time_s=time_s,
        )
        return report

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
            replay = [[update_ids[lo + m][r.layer] for r in self.built.routers]
                      for m in range(len(mini))]  # fmt: skip
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

    def _gaps(self, mbs, minis, old_logp, other_logp) -> dict:
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
                for j, s, r, ok in zip(mb.index, mb.per_sample(lp), mb.per_sample(mb.rollout_logp),
                                       mb.per_sample(sel), strict=True):  # fmt: skip
                    per_sample[j] = (s[ok].numpy(), r[ok].numpy())
            pairs = self._in_batch_order(per_sample)
            trainer = np.concatenate([p[0] for p in pairs]) if pairs else np.zeros(0)
            rollout = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0)
            name = GAP_NAMES[Routing.NATURAL if routing is not Routing.ROLLOUT else routing]
            gap[name] = metrics.logprob_gap(trainer, rollout).as_dict()
            gap[name]["pass"] = key
        return gap

    def _agreement(self, totals: np.ndarray) -> dict:
        k = self.built.geometry.topk
        rows = int(totals[0, 2]) if totals.size else 0
        return {
            "layers": list(self.built.geometry.moe_layers),
            "exact": [float(s / n) for s, _, n in totals] if rows else [],
            "overlap": [float(o / (k * n)) for _, o, n in totals] if rows else [],
            "rows": rows,
        }

    def _replay_followed(self, totals: np.ndarray) -> dict:
        """Per MoE layer, the fraction of router rows with a recorded route whose experts, as
        megatron's routing map sent them, are exactly the record's row for that token: over
        every replayed pass (old log-probs, each update pass, each recompute in backward) and
        every rank's rows; ``rows``: the rows compared, summed over those passes."""
        return {
            "layers": list(self.built.geometry.moe_layers),
            "exact": [float(same / rows) if rows else 1.0 for same, _, rows in totals],
            "rows": [int(rows) for rows in totals[:, 2]],
        }

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
            spans = [(t.token_start, t.token_end, t.generated_start, t.policy_version)
                     for t in rollout.turns]  # fmt: skip
        else:
            first = np.flatnonzero(sample.generated)
            gen = int(first[0]) if first.size else sample.token_ids.size
            spans = [(0, sample.token_ids.size, gen, 0)]
        turns = [Turn(s, e, g, v, lp[g:e].astype(np.float32)) for s, e, g, v in spans]
        return Record(sample.sample_id, self.built.geometry, sample.token_ids, routes, turns,
                      sample.group_id)  # fmt: skip


def _same_fraction(counts: np.ndarray) -> float:
    """Mean over layers with compared rows of the fraction whose natural top-k set was used."""
    fractions = [same / rows for same, _, rows in counts if rows]
    return float(np.mean(fractions)) if fractions else 1.0


class _AuxLoss:
    """Megatron's load-balancing aux loss of the update passes, per MoE layer.

    Megatron's router adds ``aux_loss / coeff`` to its layer-wise tracker in every training
    forward (``save_to_aux_losses_tracker``); the loss itself is computed from the router's
    *natural* top-k (``compute_routing_scores_for_aux_loss``), never the replayed routes. The
    tracker is cleared before the update passes and read after them (mean per forward); under
    pipeline stages each stage holds its own layers' entries, summed over the stages.
    """

    NAME = "load_balancing_loss"

    def __init__(self, built: TrainerModel):
        self.layers = list(built.geometry.moe_layers)
        routers = built.routers
        self.enabled = bool(routers) and routers[0].router.is_aux_loss_enabled()
        if self.enabled:
            from megatron.core.transformer.moe import moe_utils

            self.moe_utils = moe_utils
            moe_utils.clear_aux_losses_tracker()

    def read(self, forwards: int, mp=None) -> list[float] | None:
        if not self.enabled:
            return None
        entry = self.moe_utils.get_moe_layer_wise_logging_tracker().get(self.NAME)
        values = entry["values"].detach().cpu().clone().double() if entry is not None else None
        if mp is not None and mp.pp_group is not None and mp.pp_group.size() > 1:
            if values is None:
                values = torch.zeros(max(self.layers) + 1, dtype=torch.float64)
            dist.all_reduce(values, group=mp.pp_group)
        if values is None:
            return None
        self.moe_utils.clear_aux_losses_tracker()
        return [float(values[layer]) / max(forwards, 1) for layer in self.layers]
