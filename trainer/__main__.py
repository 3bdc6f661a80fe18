"""``python -m trainer --config FILE [section.key=value ...] --ids a,b,c --steps N``

Runs N RL steps in one process (world size 1, gloo) and prints the consistency report of each
step. Under ``torchrun`` (``WORLD_SIZE`` set) every process is one rank of the ``parallel.*``
sizes: data, tensor, expert or pipeline parallel (``torchrun --nproc-per-node 2 -m trainer
... parallel.dp=2``, or ``parallel.tp=2 parallel.sequence_parallel=true``, ``parallel.ep=2``,
``parallel.pp=2``); each DP rank trains its share of every batch and one rank prints and writes
the reports.
Samples come from the route cache (``route_cache.target`` and the ids) or from a records file
(``router_replay.replay_file`` or ``data.records_file``; every record in it when no ids are
given). With ``data.source=feed`` there are no ids: batches of whole GRPO groups come from
the route cache's ready feed (``trainer.data.source.FeedPlans``). ``--report FILE`` (or
``report.json``) writes the reports as JSON; ``--metrics`` (``report.metrics=true``) serves
Prometheus metrics from the lead rank on ``--metrics-port`` (default 9466).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

from routereplay.allocator import keep_large_buffers


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML configuration file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, section.key=value")
    parser.add_argument("--ids", help="comma-separated sample ids (or @FILE, one per line)")
    parser.add_argument("--steps", type=int, help="steps to run (train.steps)")
    parser.add_argument("--report", help="write the reports as JSON here (report.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="serve Prometheus metrics from the lead rank (report.metrics)",
    )
    parser.add_argument("--metrics-port", type=int, help="their port (report.metrics_port)")
    return parser.parse_args(argv)


def sample_ids(spec: str | None, config) -> list[str]:
    if spec:
        text = Path(spec[1:]).read_text() if spec.startswith("@") else spec.replace(",", "\n")
        return [s.strip() for s in text.splitlines() if s.strip()]
    path = config.router_replay.replay_file or config.data.records_file
    if not path:
        raise SystemExit("--ids is needed with the route cache")
    from routereplay.domain.record_file import load_records

    return [r.sample_id for r in load_records(path)]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    keep_large_buffers()
    torch.set_num_threads(args.threads)
    from trainer.config import DataSource, load_config
    from trainer.data.source import plan_batches
    from trainer.distributed import single_process
    from trainer.train import train

    overrides = list(args.overrides)
    if args.steps:
        overrides.append(f"train.steps={args.steps}")
    if args.report:
        overrides.append(f"report.json={args.report}")
    if args.metrics:
        overrides.append("report.metrics=true")
    if args.metrics_port is not None:
        overrides.append(f"report.metrics_port={args.metrics_port}")
    config = load_config(args.config, overrides)
    plans = None  # data.source=feed: train() reads them from the feed
    if config.data.source is DataSource.IDS:
        ids = sample_ids(args.ids, config)
        plans = plan_batches(ids, config.train.batch_size, config.train.steps)
    elif args.ids:
        raise SystemExit("--ids and data.source=feed exclude each other")
    if "WORLD_SIZE" in os.environ:
        return _main_torchrun(config, plans)
    if config.parallel.dp not in (None, 1):
        raise SystemExit(f"parallel.dp={config.parallel.dp} needs torchrun (one process per rank)")
    with tempfile.TemporaryDirectory() as rendezvous:
        groups = single_process.init_single_process(f"file://{rendezvous}/pg", config.train.seed)
        try:
            train(config, plans, pg_collection=groups)
        finally:
            single_process.shutdown()
    return 0


def _main_torchrun(config, plans) -> int:
    """One rank of a torchrun world: megatron's groups for the parallel sizes, the DP share,
    rank 0 reports."""
    from trainer.distributed import dp as data_parallel
    from trainer.distributed.world import init_world
    from trainer.sharding import ParallelismError
    from trainer.train import train

    sizes = config.parallel.sizes()
    world_size = int(os.environ["WORLD_SIZE"])
    dp_size = sizes.dp(world_size)  # every rank refuses a bad world alike, before any collective
    if config.parallel.dp is not None and config.parallel.dp != dp_size:
        raise ParallelismError(
            f"parallel.dp={config.parallel.dp} but world size {world_size} leaves {dp_size} "
            f"data-parallel ranks"
        )
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(logging.WARNING)
    world = init_world(sizes, seed=config.train.seed)
    try:
        train(config, plans, pg_collection=world.pg_collection, dp=data_parallel.from_world(world))
    finally:
        from trainer.distributed import single_process

        single_process.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
