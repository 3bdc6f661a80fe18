"""One RL step on a fetched batch, in mode disabled, R2 or R3, with its consistency report.

Order: rewards and GRPO advantages; the old-logprob pass (no gradients) per micro-batch; a
comparison pass (no gradients, ``report.compare``) with the other routing, so every step
reports the gap to the rollout with replay and without; then ``ppo_epochs`` passes over the
micro-batches, each micro-batch a forward, a backward and an optimizer step.

| mode | old-logprob pass | update passes | comparison pass |
|---|---|---|---|
| disabled | natural | natural | replays the rollout's routes |
| R2 | natural, recorded (``r2.record_pass``) | replay what was recorded | replays the rollout's |
| R3 | replays the rollout's routes | replay the rollout's routes | natural |

Routing agreement is always measured on the natural pass (the old-logprob pass in disabled and
R2, the comparison pass in R3; without a comparison pass in R3, the natural top-k of the
replayed pass's router logits). In each update pass, the routers' natural top-k is compared
with the routes of the old-logprob pass (``update_agreement``): with replay the routes used stay
those, whatever the optimizer did to the routers; ``disabled`` follows the drift. In R3 the
old-logprob pass also checks that replay happened: the experts each router's routing map (its
output, after replay) sent a token to are compared with the rollout's route for that token
(``replay_followed``; 1.0 per layer unless replay failed).

Data parallel (``trainer.dp``): each DP rank runs the step on its own samples (its share of
every global micro-batch); the advantages come from every rank's rewards, each backward's
gradients are summed over the ranks with the loss normalised by the global token count, and
the report is reduced over the ranks, so every rank returns the report of the whole batch.

Tensor and expert parallel (``dp.model``, a ``trainer.dp.ModelParallel``): the ranks of a TP
group run the step on the same samples. Each micro-batch is padded to a multiple of the TP
size (sequence parallelism splits it), each router replays its rank's share of the routes
(``reshard.shard_padded``), and the vocabulary-parallel logits and the routers' natural top-k
are gathered over the TP group, so the rest of the step sees what one rank would. Experts need
nothing: routes name global experts and the dispatcher sends tokens to the rank holding them.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import numpy as np
import torch

from routereplay.record import Record, Turn
from trainer import metrics, rl
from trainer.align import align_routes, routes_from_recorded
from trainer.config import ReplayMode, TrainerConfig
from trainer.data import FetchedBatch
from trainer.dp import SINGLE, DataParallel
from trainer.model import TrainerModel
from trainer.r2 import record_pass
from trainer.reshard import shard_padded


class RLStep:
    """Runs steps on one model. ``routes_used`` holds, after each step, the records of the
    routes its update passes used (R3: the rollout's; R2: recorded; disabled: the natural
    routes of the old-logprob pass), for ``router_replay.record_file``."""

    def __init__(
        self, built: TrainerModel, optimizer, config: TrainerConfig, dp: DataParallel = SINGLE
    ):
        self.built = built
        self.dp = dp
        self.mp = dp.model
        self.tp = self.mp.tp if self.mp is not None else 1
        self.optimizer = optimizer
        self.config = config
        self.mode = config.router_replay.mode
        self.compare = config.report.compare
        if (self.mode is not ReplayMode.DISABLED or self.compare) and built.replay is None:
            raise ValueError(f"mode {self.mode.value} / report.compare need routing_replay=True")
        self.routes_used: list[Record] = []

    # -- passes -------------------------------------------------------------------------------

    def _scope(self):
        return self.built.replay.step() if self.built.replay else contextlib.nullcontext()

    def _shard(self, mb: rl.MicroBatch, indices: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of the routes to replay (its sequence shard under TP)."""
        if self.mp is None:
            return indices
        return [shard_padded(i, mb.batch.seq_len, self.mp.layout, self.mp.coords) for i in indices]

    def _forward(self, mb: rl.MicroBatch, indices=None, natural=None) -> torch.Tensor:
        b = mb.batch
        if indices is not None:
            indices = self._shard(mb, indices)
        replay = (
            self.built.replay.forward(indices) if indices is not None else contextlib.nullcontext()
        )
        capture = natural.capture() if natural is not None else contextlib.nullcontext()
        with replay, capture:
            logits = self.built.model(b.token_ids, b.position_ids(), b.attention_mask())
        if self.tp == 1:
            return logits
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        # Vocabulary slices -> full logits (the backward hands each rank its slice again).
        return gather_from_tensor_model_parallel_region(logits, group=self.mp.tp_group)

    def _last(self, natural: metrics.NaturalTopk) -> list[torch.Tensor]:
        """The last call's natural top-k of every router, over the whole micro-batch (its
        sequence shards gathered over the TP group)."""
        last = natural.last()
        if self.tp == 1:
            return last
        out = []
        for shard in last:
            parts = [torch.empty_like(shard) for _ in range(self.tp)]
            torch.distributed.all_gather(parts, shard.contiguous(), group=self.mp.tp_group)
            out.append(torch.cat(parts))
        return out

    def _backward(self, replaying: bool):
        return self.built.replay.backward() if replaying else contextlib.nullcontext()

    def _natural(self) -> metrics.NaturalTopk:
        return metrics.NaturalTopk(self.built.routers, self.built.geometry.topk)

    def _align(self, mb: rl.MicroBatch, records):
        return align_routes(
            mb.batch, records, self.built.geometry, [r.layer for r in self.built.routers],
            missing="native",
        )  # fmt: skip

    def _records(self, mb: rl.MicroBatch, routes, old_logp) -> list[Record]:
        """Per-sample routes as records (the rollout's turns, the trainer's log-probs)."""
        out = []
        for b, sample in enumerate(mb.samples):
            start = int(mb.batch.starts[b])
            lp = old_logp[b, start : start + sample.token_ids.size].numpy()
            rollout = mb.records[b]
            if rollout is not None:
                spans = [(t.token_start, t.token_end, t.generated_start, t.policy_version)
                         for t in rollout.turns]  # fmt: skip
            else:
                first = np.flatnonzero(sample.generated)
                gen = int(first[0]) if first.size else sample.token_ids.size
                spans = [(0, sample.token_ids.size, gen, 0)]
            turns = [Turn(s, e, g, v, lp[g:e].astype(np.float32)) for s, e, g, v in spans]
            out.append(Record(sample.sample_id, self.built.geometry, sample.token_ids,
                              routes[b], turns, sample.group_id))  # fmt: skip
        return out

    # -- the step -----------------------------------------------------------------------------

    def run(self, fetched: FetchedBatch, step: int = 0) -> dict:
        """Train on one batch; returns the step's report (see ``docs/trainer.md``)."""
        cfg, mode = self.config.train, self.mode
        times: dict[str, float] = defaultdict(float)
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            times[name] += now - clock
            clock = now

        dp = self.dp
        samples = fetched.samples
        local_mb = max(cfg.micro_batch_size // dp.size, 1)
        rewards, adv = self._advantages(samples, local_mb)
        multiple = self.mp.layout.multiple if self.mp is not None else 1
        side = self.config.train.padding_side
        mbs = rl.micro_batches(samples, fetched.records, adv, local_mb, side, multiple)
        n_mbs = int(dp.max(len(mbs)))  # a rank short of samples still joins every collective
        need_rollout = mode is ReplayMode.R3 or self.compare
        rollout_ids = [self._align(mb, mb.records) for mb in mbs] if need_rollout else None
        lap("align")

        # Old-logprob pass.
        old, natural_routes, used_ids, exp_reward = [], [], [], []
        followed = np.zeros((len(self.built.routers), 2), np.int64)
        r2_records: list[Record] = []
        for i, mb in enumerate(mbs):
            natural = self._natural()
            with torch.no_grad(), self._scope():
                if mode is ReplayMode.R2 and self.tp == 1:
                    (logits,), recorded = record_pass(
                        self.built, [mb.batch], lambda m, b, mb=mb: self._forward(mb)
                    )
                elif mode is ReplayMode.R3:
                    with _routing_used(self.built.routers, self.built.geometry.topk) as used:
                        logits = self._forward(mb, rollout_ids[i].indices, natural)
                    followed += _topk_counts(used, self._shard(mb, rollout_ids[i].indices))
                else:
                    logits = self._forward(mb, natural=natural)
            logp = rl.token_logprobs(logits, mb.batch.token_ids)
            old.append(logp)
            mass = rl.target_mass(logits)
            exp_reward.append(mass[mb.generated])
            if mode is ReplayMode.R2 and self.tp == 1:
                routes = [r.routes for r in recorded]
            else:
                # Under TP, R2 keeps the natural top-k of this (natural) pass: what megatron's
                # RECORD would hold, gathered over the sequence shards.
                routes = routes_from_recorded(mb.batch, self._last(natural), self.built.geometry)
            natural_routes.append(routes)
            if mode is ReplayMode.R3:
                used_ids.append(rollout_ids[i])
            else:
                recs = self._records(mb, routes, logp)
                r2_records.extend(recs)
                used_ids.append(self._align(mb, recs))
        lap("old_logprob")

        # Comparison pass: the other routing, same weights, same step.
        other = [None] * len(mbs)
        if self.compare:
            for i, mb in enumerate(mbs):
                natural = self._natural() if mode is ReplayMode.R3 else None
                with torch.no_grad(), self._scope():
                    if mode is ReplayMode.R3:
                        logits = self._forward(mb, natural=natural)
                        natural_routes[i] = routes_from_recorded(
                            mb.batch, self._last(natural), self.built.geometry
                        )
                    else:
                        logits = self._forward(mb, rollout_ids[i].indices)
                other[i] = rl.token_logprobs(logits, mb.batch.token_ids)
        lap("compare")

        report = self._consistency(mbs, old, other, natural_routes)
        if mode is ReplayMode.R3:
            report["replay_followed"] = self._replay_followed(followed)
        self.routes_used = (
            [r for mb in mbs for r in mb.records if r is not None]
            if mode is ReplayMode.R3
            else r2_records
        )
        if dp.enabled and self.config.router_replay.record_file:
            self.routes_used = self._gathered_routes(mbs)

        # Update passes.
        aux = _AuxLoss(self.built)
        losses, clips, drift = [], [], []
        replay_update = mode is not ReplayMode.DISABLED
        layers = len(self.built.routers)
        for _epoch in range(cfg.ppo_epochs):
            agree = []
            for i in range(n_mbs):
                self.optimizer.zero_grad()
                if i >= len(mbs):  # no samples left here: zero gradients into the sum
                    dp.sum([0])
                    dp.reduce_gradients(self.built.model)
                    self.optimizer.step()
                    losses.append(0.0)
                    clips.append(0.0)
                    agree.append(np.zeros((layers, 2), np.int64))
                    continue
                mb = mbs[i]
                tokens = int(dp.sum([int(mb.generated.sum())])[0]) if dp.enabled else None
                natural = self._natural()
                with self._scope():
                    indices = used_ids[i].indices if replay_update else None
                    logits = self._forward(mb, indices, natural)
                    logp = rl.token_logprobs(logits, mb.batch.token_ids)
                    loss, clip = rl.ppo_loss(
                        logp, old[i], mb.advantages, mb.generated, cfg.clip_eps, tokens
                    )
                    with self._backward(replay_update):
                        loss.backward()
                dp.reduce_gradients(self.built.model)
                self.optimizer.step()
                losses.append(loss.item())
                clips.append(clip)
                agree.append(_topk_counts(self._last(natural), used_ids[i].indices))
            counts = dp.sum(np.stack(agree), dtype=torch.int64).numpy() if agree else []
            drift.append(float(np.mean([_same_fraction(c) for c in counts])))
        lap("update")
        aux_layers = aux.read(cfg.ppo_epochs * len(mbs))
        if dp.enabled:
            losses = dp.sum(losses).tolist()
            clips = dp.sum(clips).tolist()
            if aux_layers is not None:
                aux_layers = (dp.sum(aux_layers) / dp.size).tolist()

        gen_mass = torch.cat(exp_reward) if exp_reward else torch.zeros(0)
        totals = dp.sum([
            sum(int(mb.batch.valid.sum()) for mb in mbs),
            sum(int(a.replayed.sum()) for a in used_ids) if replay_update else 0,
            float(gen_mass.double().sum()), gen_mass.numel(),
            len(samples), len(fetched.missing), len(fetched.dropped),
        ]).tolist()  # fmt: skip
        valid, replayed, mass_sum, mass_n, n_samples, missing, dropped = totals
        valid, replayed = int(valid), int(replayed)
        if dp.enabled:
            expected = mass_sum / mass_n if mass_n else 0.0
        else:
            expected = float(gen_mass.mean()) if gen_mass.numel() else 0.0
        time_s = {"fetch": fetched.fetch_s, "fetch_wait": fetched.wait_s, **times}
        if dp.enabled:  # the slowest rank's time (the step waits for it)
            time_s = {k: max(t[k] for t in dp.all_gather(time_s)) for k in time_s}
        report.update(
            step=step,
            mode=mode.value,
            samples=int(n_samples),
            reward_mean=float(np.mean(rewards)) if rewards else 0.0,
            expected_reward=expected,
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
            time_s=time_s,
        )
        return report

    # -- data parallel ------------------------------------------------------------------------

    def _advantages(self, samples, local_mb: int) -> tuple[list[float], np.ndarray]:
        """Rewards of the whole batch (in the single-rank order) and this rank's advantages,
        normalised within each GRPO group over every DP rank's samples."""
        rewards = [rl.reward(s) for s in samples]
        groups = [s.group_id for s in samples]
        if not self.dp.enabled:
            return rewards, rl.group_advantages(rewards, groups)
        rank = self.dp.rank
        entries = sorted(
            (j // local_mb, r, j, reward, group)
            for r, part in enumerate(self.dp.all_gather(list(zip(rewards, groups, strict=True))))
            for j, (reward, group) in enumerate(part)
        )
        adv = rl.group_advantages([e[3] for e in entries], [e[4] for e in entries])
        mine = np.array([a for e, a in zip(entries, adv, strict=True) if e[1] == rank])
        return [e[3] for e in entries], mine.astype(np.float32)

    def _merged(self, per_mb: list) -> list:
        """Per-micro-batch items of every DP rank, in the single-rank order (micro-batch, then
        DP rank)."""
        if not self.dp.enabled:
            return per_mb
        parts = self.dp.all_gather(per_mb)
        n = max(len(p) for p in parts)
        return [p[i] for i in range(n) for p in parts if i < len(p)]

    def _replay_followed(self, counts: np.ndarray) -> dict:
        """Per MoE layer, the fraction of rows with a rollout route whose experts, as megatron's
        routing map sent them, are exactly the rollout's (every rank's rows summed: DP ranks
        hold other samples, TP ranks other sequence shards)."""
        if torch.distributed.is_initialized():
            total = torch.from_numpy(counts)
            torch.distributed.all_reduce(total)
            counts = total.numpy()
        return {
            "layers": list(self.built.geometry.moe_layers),
            "exact": [float(same / rows) if rows else 1.0 for same, rows in counts],
            "rows": [int(rows) for rows in counts[:, 1]],
        }

    def _gathered_routes(self, mbs) -> list[Record]:
        if self.mode is ReplayMode.R3:
            per_mb = [[r for r in mb.records if r is not None] for mb in mbs]
        else:
            it = iter(self.routes_used)
            per_mb = [[next(it) for _ in mb.samples] for mb in mbs]
        return [r for part in self._merged(per_mb) for r in part]

    def _consistency(self, mbs, old, other, natural_routes) -> dict:
        """Gap and agreement against the rollout, per routing (over every DP rank)."""
        mode = self.mode
        per_pass = {"old": old, "other": other}
        names = {
            ReplayMode.DISABLED: ("natural", "replayed"),
            ReplayMode.R2: ("natural", "replayed"),
            ReplayMode.R3: ("replayed", "natural"),
        }[mode]
        gap = {}
        for (key, passes), name in zip(per_pass.items(), names, strict=True):
            if passes[0] is None:
                continue
            pairs = []
            for mb, lp in zip(mbs, passes, strict=True):
                sel = mb.generated & ~torch.isnan(mb.rollout_logp)
                pairs.append((lp[sel].numpy(), mb.rollout_logp[sel].numpy()))
            pairs = self._merged(pairs)
            trainer = np.concatenate([p[0] for p in pairs]) if pairs else np.zeros(0)
            rollout = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0)
            gap[name] = metrics.logprob_gap(trainer, rollout).as_dict()
            gap[name]["pass"] = "old_logprob" if key == "old" else "compare"
        counts = []
        for mb, routes in zip(mbs, natural_routes, strict=True):
            kept = [(nat, rec.routes) for rec, nat in zip(mb.records, routes, strict=True)
                    if rec is not None]  # fmt: skip
            counts.append(metrics.agreement_counts([k[0] for k in kept], [k[1] for k in kept]))
        counts = [c for c in self._merged(counts) if c.size]
        counts = np.concatenate(counts) if counts else np.zeros((0, 0), np.int64)
        return {
            "gap": gap,
            "agreement": {
                "layers": list(self.built.geometry.moe_layers),
                **metrics.agreement_from_counts(counts, self.built.geometry.topk),
            },
        }


@contextlib.contextmanager
def _routing_used(routers, topk: int):
    """Per router, the experts its routing map (megatron's own output, after replay) sent each
    token of the last call to: int64 ``[tokens, topk]``, filled in as the routers run."""
    used: list[torch.Tensor | None] = [None] * len(routers)

    def hook(j):
        def record(module, args, output):
            used[j] = output[1].detach().float().topk(topk, dim=-1).indices

        return record

    handles = [r.router.register_forward_hook(hook(j)) for j, r in enumerate(routers)]
    try:
        yield used
    finally:
        for handle in handles:
            handle.remove()


def _topk_counts(natural: list[torch.Tensor], used: list[torch.Tensor]) -> np.ndarray:
    """int64 ``[layers, 2]``: per layer, the routed rows whose natural top-k set equals the one
    used, and the routed rows (rows ``MASKED`` in ``used`` are skipped)."""
    out = np.zeros((len(used), 2), np.int64)
    for j, (nat, ids) in enumerate(zip(natural, used, strict=True)):
        rows = ids[:, 0] >= 0
        same = nat[rows].sort(-1).values == ids[rows].sort(-1).values
        out[j] = int(same.all(-1).sum()), int(rows.sum())
    return out


def _same_fraction(counts: np.ndarray) -> float:
    """Mean over layers with routed rows of the fraction whose natural top-k set was used."""
    fractions = [same / rows for same, rows in counts if rows]
    return float(np.mean(fractions)) if fractions else 1.0


class _AuxLoss:
    """Megatron's load-balancing aux loss of the update passes, per MoE layer.

    Megatron's router adds ``aux_loss / coeff`` to its layer-wise tracker in every training
    forward (``save_to_aux_losses_tracker``); the loss itself is computed from the router's
    *natural* top-k (``compute_routing_scores_for_aux_loss``), never the replayed routes. The
    tracker is cleared before the update passes and read after them (mean per forward).
    """

    NAME = "load_balancing_loss"

    def __init__(self, built: TrainerModel):
        self.layers = [r.layer for r in built.routers]
        self.enabled = bool(built.routers) and built.routers[0].router.is_aux_loss_enabled()
        if self.enabled:
            from megatron.core.transformer.moe import moe_utils

            self.moe_utils = moe_utils
            moe_utils.clear_aux_losses_tracker()

    def read(self, forwards: int) -> list[float] | None:
        if not self.enabled:
            return None
        entry = self.moe_utils.get_moe_layer_wise_logging_tracker().get(self.NAME)
        if entry is None:
            return None
        values = entry["values"].detach().cpu().clone()
        self.moe_utils.clear_aux_losses_tracker()
        return [float(values[layer]) / max(forwards, 1) for layer in self.layers]
