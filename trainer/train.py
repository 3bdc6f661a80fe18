"""The training loop: batches in, RL steps, the consistency report out.

``train(config, plans)`` builds the model and optimizer, fetches each planned batch (prefetching
the next one), runs one ``RLStep`` per batch and hands its ``StepReport`` to the outputs the
configuration turns on (``trainer.report.outputs``: metrics, export and push, console,
TensorBoard, checkpoint, feed acknowledgement, records file, JSON report, in that order), and
returns the per-step reports. With ``train.resume`` and a checkpoint in ``checkpoint_dir``, the
loop restores it and skips the steps it had done.

Data parallel (``dp``, a ``trainer.distributed.dp.DataParallel``): every rank gets the same plans,
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
import logging
import time
from collections.abc import Iterable
from dataclasses import replace

import torch

from trainer import checkpoint
from trainer.config import Dtype, TrainerConfig
from trainer.data.source import (
    BatchPlan,
    CacheSource,
    FeedPlans,
    FetchedBatch,
    Prefetcher,
    open_source,
)
from trainer.data.stage_reads import stage_reads
from trainer.distributed.dp import SINGLE, DataParallel
from trainer.distributed.world import model_overrides
from trainer.model.build import TrainerModel, build_model
from trainer.optim import AdamW
from trainer.report.outputs import Output, Run, StepDone, outputs_for
from trainer.report.step_report import StepReport
from trainer.rl.step import RLStep

log = logging.getLogger(__name__)

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def build(config: TrainerConfig, pg_collection=None) -> tuple[TrainerModel, AdamW]:
    """The model and AdamW. Replay is installed in every mode: the step observes what each
    router did through it (with no action set, a router routes naturally)."""
    torch.manual_seed(config.train.seed)
    overrides: dict = model_overrides(config.parallel.sizes())
    overrides.update(
        num_layers_in_first_pipeline_stage=config.parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=config.parallel.last_stage_layers,
    )
    if config.train.dtype is Dtype.BFLOAT16:
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
        drop_mtp_layers=config.model.drop_mtp_layers,
        **overrides,
    )
    return built, AdamW(built.model, config.train.lr, config.train.weight_decay)


def train(
    config: TrainerConfig,
    plans: Iterable[BatchPlan] | None,
    *,
    pg_collection=None,
    source=None,
    built: tuple[TrainerModel, AdamW] | None = None,
    dp: DataParallel = SINGLE,
) -> list[StepReport]:
    """Run one step per plan; returns the reports (also logged, and written when configured).

    Args:
        config: The configuration.
        plans: The batches, in order (ids, or ids with samples); None with
            ``data.source=feed`` (read from the feed, ``FeedPlans``).
        pg_collection: megatron's process groups (``single_process.init_single_process``).
        source: The records' source (default: ``trainer.data.source.open_source(config)``).
        built: A model and optimizer to reuse (default: ``build(config)``).
        dp: The data-parallel group (default: one rank).
    """
    cfg = config.train
    dp.check(cfg.batch_size, cfg.micro_batch_size, cfg.mini_batch_size_or_micro)
    own_source = source is None
    source = source or open_source(config)
    model, optimizer = built or build(config, pg_collection)
    source = _by_stage(config, source, dp, model)
    dp.broadcast_parameters(model.model)
    start = resume(config, model, optimizer, dp)
    stepper = RLStep(model, optimizer, config, dp)
    # The feed is read through the records' client when there is one (one connection).
    feed = FeedPlans(config, dp, getattr(source, "client", None)) if plans is None else None
    # The feed has no step numbers: a resumed run takes the next batches it offers.
    todo = (
        itertools.islice(feed, max(0, cfg.steps - start))
        if feed
        else itertools.islice(plans, start, None)
    )
    outputs = outputs_for(Run(config, model, optimizer, dp, feed))
    reports: list[StepReport] = []
    last = None
    try:
        fetcher = Prefetcher(
            source,
            (dp.shard_plan(p, cfg.mini_batch_size_or_micro) for p in todo),
            config.router_replay.missing_record,
            config.data.prefetch and feed is None,  # a feed batch is read when wanted
        )
        for last, fetched in enumerate(fetcher, start):
            reports.append(_step(stepper, outputs, fetched, last))
        for output in outputs:
            output.finish(last, reports)
    finally:
        for output in reversed(outputs):
            output.close()
        if own_source:
            source.close()
    return reports


def _by_stage(config: TrainerConfig, source, dp: DataParallel, model: TrainerModel):
    """With ``data.stage_reads``, route cache reads of each pipeline stage's layers only, once
    per model-parallel group (``trainer.data.stage_reads``); ``source`` otherwise."""
    if isinstance(source, CacheSource) and config.data.stage_reads:
        return stage_reads(source, dp, model.geometry.moe_layers, [r.layer for r in model.routers])
    return source


def _step(stepper: RLStep, outputs: list[Output], fetched: FetchedBatch, step: int) -> StepReport:
    """One RL step, then every output in the table's order; returns the report as the outputs
    left it (what an output learns goes to the outputs after it)."""
    started = time.perf_counter()
    result = stepper.run(fetched, step)
    seconds = time.perf_counter() - started + fetched.wait_s
    done = StepDone(step, result.report, seconds, result.routes_used, fetched.dead_letters)
    for output in outputs:
        learned = output.after_step(done)
        if learned:
            done = replace(done, report=replace(done.report, **learned))
    return done.report


def resume(config: TrainerConfig, model: TrainerModel, optimizer: AdamW, dp: DataParallel) -> int:
    """With ``train.resume`` and a checkpoint, restore it; returns the steps already done."""
    shard = dp.model.shard if dp.model is not None else ""
    found = checkpoint.latest(config.train.checkpoint_dir, shard) if config.train.resume else None
    return checkpoint.load(found, model, optimizer) if found is not None else 0
