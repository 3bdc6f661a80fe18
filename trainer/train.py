"""The training loop: batches in, RL steps, the consistency report out.

``train(config, plans)`` builds the model and optimizer, fetches each planned batch (prefetching
the next one), runs one ``RLStep`` per batch, logs one line per step, writes
``router_replay.record_file`` (the routes used, layout-free, ``save_records``) and
``report.json`` at the end, and returns the per-step reports. Hooks after each step: the
report to TensorBoard (``report.tensorboard_dir``) and to Prometheus (``report.metrics``,
``trainer.monitoring``), the weights exported in the Hugging Face
layout every ``train.export_every`` steps (``train.export_dir``, for the rollout server's
``UpdateWeights``), a checkpoint every ``train.checkpoint_every`` steps
(``train.checkpoint_dir``); both also after the last step. With ``train.resume`` and a
checkpoint in ``checkpoint_dir``, the loop restores it and skips the steps it had done.

Data parallel (``dp``, a ``trainer.parallel.dp.DataParallel``): every rank gets the same plans,
fetches and trains its own share of each batch, and returns the whole batch's reports; the lead (DP
rank 0, TP rank 0, the first stage) logs them and writes the record file, the report JSON,
TensorBoard, exports and checkpoints. Under tensor, expert or pipeline parallelism every rank
gathers its stage's full weights for an export (a collective the lead writes out) and writes
its own checkpoint file (``checkpoint``).

The input is an iterable of ``BatchPlan``: sample ids from the command line, or, with
``data.source=feed``, the route cache's ready feed (``trainer.data.source.FeedPlans``): the lead
reads whole GRPO groups and hands every rank the batch, and acknowledges them after the
batch's optimizer step. With ``push.targets`` each export is loaded by those rollout
servers (``UpdateWeights``), so their next samples come from the new policy; the step's
report then names the versions (``policy_versions``) and the rollout versions the batch was
generated with (``feed``).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from routereplay.domain.record import Record
from routereplay.domain.record_file import save_records
from trainer import checkpoint
from trainer.config import TrainerConfig
from trainer.data.source import BatchPlan, CacheSource, FeedPlans, FileSource, Prefetcher
from trainer.data.stage_reads import stage_reads
from trainer.model.build import TrainerModel, build_model
from trainer.parallel.dp import SINGLE, DataParallel
from trainer.parallel.world import model_overrides
from trainer.rl.optim import AdamW
from trainer.rl.step import RLStep

log = logging.getLogger(__name__)

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def open_source(config: TrainerConfig):
    """The records' source: a file (``replay_file`` or ``data.records_file``) or the cache."""
    path = config.router_replay.replay_file or config.data.records_file
    if path:
        return FileSource(path)
    return CacheSource(config.route_cache.target, security=config.route_cache.security())


def build(config: TrainerConfig, pg_collection=None) -> tuple[TrainerModel, AdamW]:
    """The model and AdamW. Replay is installed in every mode: the step observes what each
    router did through it (with no action set, a router routes naturally)."""
    torch.manual_seed(config.train.seed)
    overrides: dict = model_overrides(config.parallel.layout())
    overrides.update(
        num_layers_in_first_pipeline_stage=config.parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=config.parallel.last_stage_layers,
    )
    if config.train.dtype == "bfloat16":
        overrides.update(params_dtype=torch.bfloat16, bf16=True)
        if "pipeline_dtype" in overrides:
            overrides["pipeline_dtype"] = torch.bfloat16
    if config.model.recompute:
        overrides.update(RECOMPUTE)
    if config.model.aux_loss_coeff > 0:
        coeff = config.model.aux_loss_coeff
        overrides.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=coeff)
    built = build_model(
        config.model.path,
        routing_replay=True,
        pg_collection=pg_collection,
        model_id=config.model.model_id or None,
        **overrides,
    )
    return built, AdamW(built.model, config.train.lr, config.train.weight_decay)


def summary(report: dict) -> str:
    """One console line per step."""
    gap = "  ".join(
        f"gap[{name}] mean {g['mean_abs']:.2e} max {g['max_abs']:.2e} k3 {g['k3_kl']:.1e}"
        for name, g in report["gap"].items()
    )
    agree = " ".join(f"{x:.4f}" for x in report["agreement"]["exact"])
    t = report["time_s"]
    return (
        f"step {report['step']} [{report['mode']}] reward {report['reward_mean']:.3f} "
        f"expected {report['expected_reward']:.4f} loss {report['loss']:+.4f}  "
        f"routing agreement/layer {agree}  {gap}  "
        f"update agreement {[round(x, 4) for x in report['update_agreement']]}  "
        f"replayed rows {report['rows']['replayed_fraction']:.3f}  "
        f"missing {report['missing_records']}  "
        + (f"aux loss {report['aux_loss']:.4f}  " if report.get("aux_loss") is not None else "")
        + f"time old {t['old_logprob']:.2f}s compare {t['compare']:.2f}s update {t['update']:.2f}s "
        f"fetch wait {t['fetch_wait']:.3f}s"
    )


def train(
    config: TrainerConfig,
    plans: Iterable[BatchPlan] | None,
    *,
    pg_collection=None,
    source=None,
    built: tuple[TrainerModel, AdamW] | None = None,
    dp: DataParallel = SINGLE,
) -> list[dict]:
    """Run one step per plan; returns the reports (also logged, and written when configured).

    Args:
        config: The configuration.
        plans: The batches, in order (ids, or ids with samples); None with
            ``data.source=feed`` (read from the feed, ``FeedPlans``).
        pg_collection: megatron's process groups (``single_process.init_single_process``).
        source: The records' source (default: ``open_source(config)``).
        built: A model and optimizer to reuse (default: ``build(config)``).
        dp: The data-parallel group (default: one rank).
    """
    cfg = config.train
    dp.check(cfg.batch_size, cfg.micro_batch_size, cfg.mini_batch_size_or_micro)
    lead = dp.lead
    own_source = source is None
    source = source or open_source(config)
    model, optimizer = built or build(config, pg_collection)
    if isinstance(source, CacheSource) and config.data.stage_reads:
        routers = [r.layer for r in model.routers]
        source = stage_reads(source, dp, model.geometry.moe_layers, routers)
    dp.broadcast_parameters(model.model)
    start = 0
    shard = dp.model.shard if dp.model is not None else ""
    resume_from = checkpoint.latest(cfg.checkpoint_dir, shard) if cfg.resume else None
    if resume_from is not None:
        start = checkpoint.load(resume_from, model, optimizer)
    stepper = RLStep(model, optimizer, config, dp)
    # The feed is read through the records' client when there is one (one connection).
    feed = FeedPlans(config, dp, getattr(source, "client", None)) if plans is None else None
    if feed is not None:
        # The feed has no step numbers: a resumed run takes the next batches it offers.
        todo = itertools.islice(feed, max(0, cfg.steps - start))
    else:
        todo = itertools.islice(plans, start, None)
    reports: list[dict] = []
    used: list[Record] = []
    writer = None
    if config.report.tensorboard_dir and lead:
        from trainer.tb import ReportWriter

        writer = ReportWriter(config.report.tensorboard_dir)
    metrics = None
    if config.report.metrics and lead:
        from trainer.monitoring import TrainerMetrics

        metrics = TrainerMetrics().serve_at(config.report.metrics_host, config.report.metrics_port)
        log.info("metrics at http://%s:%d/metrics", config.report.metrics_host, metrics.port)
    step = start - 1
    exported = saved = start - 1
    try:
        fetcher = Prefetcher(
            source,
            (dp.shard_plan(p, cfg.mini_batch_size_or_micro) for p in todo),
            config.router_replay.missing_record,
            config.data.prefetch and feed is None,  # a feed batch is read when wanted
        )
        for step, fetched in enumerate(fetcher, start):
            started = time.perf_counter()
            report = stepper.run(fetched, step)
            if metrics is not None:
                metrics.observe(report, time.perf_counter() - started + fetched.wait_s)
            used.extend(stepper.routes_used)
            if cfg.export_dir and (step + 1) % cfg.export_every == 0:
                folder = export_weights(config, model, step, dp)
                if lead and config.push.targets:
                    from trainer.model.export import push_weights

                    push = config.push
                    versions = push_weights(push.targets, folder, push.security())
                    report["policy_versions"] = versions
                    log.info("rollout servers now at policy versions %s", versions)
                exported = step
            if lead:
                log.info("%s", summary(report))
            reports.append(report)
            if writer is not None:
                writer.write(report)
            if cfg.checkpoint_dir and (step + 1) % cfg.checkpoint_every == 0:
                save_checkpoint(config, model, optimizer, step, dp)
                saved = step
            if feed is not None:  # trained (and checkpointed when configured): acknowledge
                groups = feed.ack()
                if lead:
                    report["feed"] = feed_summary(groups)
        if cfg.export_dir and exported != step:
            export_weights(config, model, step, dp)
        if cfg.checkpoint_dir and saved != step:
            save_checkpoint(config, model, optimizer, step, dp)
    finally:
        if feed is not None:
            feed.close()
        if own_source:
            source.close()
        if writer is not None:
            writer.close()
        if metrics is not None:
            metrics.stop()
    if not lead:
        return reports
    if config.router_replay.record_file:
        save_records(config.router_replay.record_file, used)
    if config.report.json:
        Path(config.report.json).write_text(json.dumps(reports, indent=2))
    return reports


def feed_summary(groups) -> dict:
    """What a feed batch was: its groups and the policy versions that generated its turns."""
    versions = {v for group in groups for entry in group.entries for v in entry.policy_versions}
    return {"groups": [g.group_id for g in groups], "rollout_versions": sorted(versions)}


def export_weights(
    config: TrainerConfig, built: TrainerModel, step: int, dp: DataParallel = SINGLE
) -> Path | None:
    """Export after ``step`` to ``train.export_dir`` (``export.export_step``); logs the path for
    the rollout server's ``UpdateWeights``. Under model parallelism a collective: every rank
    gathers its stage's full weights, the stages send theirs to the lead, which writes them.
    Returns the folder (the lead; None elsewhere)."""
    from trainer.model.export import export_step

    weights = gathered_weights(built, dp) if dp.model is not None else None
    if not dp.lead:
        return None
    folder = export_step(built, config.model.path, config.train.export_dir, step, weights)
    log.info("exported weights after step %d to %s", step, folder)
    return folder


def gathered_weights(built: TrainerModel, dp: DataParallel) -> dict[str, torch.Tensor] | None:
    """The whole model's weights under megatron's global names on the first pipeline stage
    (None on the other stages): each stage's chunks gathered over their TP and EP groups, then
    sent to the first stage."""
    from trainer.model.shard_weights import full_weights

    weights: dict[str, torch.Tensor] = {}
    for chunk in built.chunks:
        weights.update(full_weights(chunk))
    group = dp.model.pp_group
    if group is None or group.size() == 1:
        return weights
    first = torch.distributed.get_global_rank(group, 0)
    stages = [None] * group.size() if group.rank() == 0 else None
    torch.distributed.gather_object(weights, stages, dst=first, group=group)
    if stages is None:
        return None
    return {name: tensor for stage in stages for name, tensor in stage.items()}


def save_checkpoint(
    config: TrainerConfig, built: TrainerModel, optimizer: AdamW, step: int, dp: DataParallel
) -> None:
    """Checkpoint after ``step``: the lead writes the one file (data parallel: every rank holds
    the same state), or every rank its shard and the lead names the step once all have."""
    root, done = config.train.checkpoint_dir, step + 1
    if dp.model is None:
        if dp.lead:
            checkpoint.save(root, done, built, optimizer, config)
        return
    checkpoint.save(root, done, built, optimizer, config, shard=dp.model.shard, mark=False)
    torch.distributed.barrier()
    if dp.lead:
        checkpoint.mark_latest(root, done)
