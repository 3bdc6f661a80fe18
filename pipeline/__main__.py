"""``python -m pipeline``: run the main job on this machine, with no GPU, Docker or Redis.

Starts the route cache (with an embedded Redis-compatible server) and the rollout server
(vLLM on the CPU, serving the embedded tiny Qwen3-MoE), generates a batch of GRPO groups
while streaming tokens, continues one sample with a second turn, reads every record back from
the route cache in one batch and checks it. Then runs the RL loop in each replay mode
(disabled, R3, R2), from the same initial weights: a prompt driver spreads each step's prompts
over the rollout server replicas; the trainer (megatron-core, data parallel under torchrun)
takes its batch of whole GRPO groups from the route cache's ready feed, trains, and pushes its
weights to the rollout servers (``UpdateWeights``); the driver waits for the new policy
version before it generates the next step's groups. It reports, per step, how far training is
from the rollout with and without replay, the policy versions and the records trained, printed
and as a PNG figure. The trainer runs in bfloat16 against the float32 rollout: different
numerics, as between a GPU engine and a trainer, which flip near-tied routing choices. Every
process it starts is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import redis

from pipeline.report import MODES, figure, mode_lines
from routereplay.dev.launch import start_service, stop_process
from routereplay.dev.tiny_model import REALISTIC_ROUTER_SPREAD, build_tiny_model
from routereplay.domain.record import check_routes
from routereplay.domain.rollout import SampleDelta, SampleDone, SampleFailed, SamplingOptions
from routereplay.families import DEFAULT_FAMILY, FAMILIES
from routereplay.rpc.client import RouteCacheClient
from routereplay.rpc.rollout_client import AsyncRolloutClient
from trainer.report.step_report import reports_from_json

PROMPTS = [
    "The router picks two experts for every token because",
    "In reinforcement learning, a policy is",
    "Mixture-of-experts models route each token to",
    "A cache keyed by sample id lets the trainer",
]


def log(message: str) -> None:
    print(f"[pipeline] {message}", flush=True)


def start(module: str, args: list[str], name: str, procs: list, port: int = 0) -> str:
    log(f"starting {name}")
    proc, target = start_service(module, *args, port=port or None, timeout_s=300)
    procs.append(proc)
    log(f"{name} is serving on {target}")
    return target


async def rollout(target: str, n: int, max_tokens: int) -> tuple[list[SampleDone], int]:
    options = SamplingOptions(temperature=1.0, max_tokens=max_tokens)
    done: list[SampleDone] = []
    streamed = 0
    async with AsyncRolloutClient(target) as client:
        groups = [f"group-{i}" for i in range(len(PROMPTS))]
        async for event in client.generate_batch(PROMPTS, n, options, group_ids=groups):
            if isinstance(event, SampleDelta):
                streamed += len(event.delta.token_ids)
            elif isinstance(event, SampleDone):
                done.append(event)
                log(
                    f"  {event.sample_id} ({event.group_id}): {event.generated_tokens} tokens, "
                    f"{event.finish_reason}, stored={event.stored}"
                )
            elif isinstance(event, SampleFailed):
                raise SystemExit(f"[pipeline] {event.sample_id} failed: {event.message}")
        second = SamplingOptions(temperature=0.0, max_tokens=max_tokens // 2)
        async for event in client.continue_sample(done[0].sample_id, " And then", second):
            if isinstance(event, SampleDelta):
                streamed += len(event.delta.token_ids)
            elif isinstance(event, SampleDone):
                log(
                    f"  {event.sample_id}: second turn, {event.generated_tokens} tokens, record "
                    f"now {event.num_tokens} tokens, stored={event.stored}"
                )
    return done, streamed


# The trainer layouts the main job offers: (processes, the trainer's layout overrides).
TRAINER_LAYOUTS = {
    "single": (1, []),
    "dp2": (2, ["parallel.dp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
}


def start_trainer(
    mode: str,
    cache: str,
    rollouts: list[str],
    model_dir: str,
    args,
    procs,
    run: str = "",
    overrides: Sequence[str] = (),
):
    """The trainer in ``mode`` on the feed, pushing its weights to ``rollouts`` after each
    step; returns its process and the path of its report. ``run`` names its report, consumer
    group and exports (default: the mode); ``overrides`` are more trainer settings
    (``train.lr=...``)."""
    run = run or mode
    report = args.out / f"trainer-{run}.json"
    batch = args.groups * args.n
    ranks, layout = TRAINER_LAYOUTS[args.layout]
    dp = ranks if args.layout.startswith("dp") else 1
    micro = batch // 2 if batch % (2 * dp) == 0 else batch
    consumer_group = f"pipeline-{run}"
    # Created before any of this run's samples exist, so the trainer takes exactly these.
    with RouteCacheClient(cache) as client:
        client.read_ready(consumer_group, "trainer", max_entries=1, start_from_latest=True)
    # The layout's ranks on gloo, as trainer pods would run them.
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "trainer",
        *layout,
        f"router_replay.mode={mode}",
        f"model.path={model_dir}",
        f"route_cache.target={cache}",
        f"train.dtype={args.trainer_dtype}",
        f"train.batch_size={batch}",
        f"train.micro_batch_size={micro}",
        "data.source=feed",
        f"data.group_size={args.n}",
        f"data.consumer_group={consumer_group}",
        f"train.export_dir={args.out / 'weights' / run}",
        f"push.targets={','.join(rollouts)}",
        *overrides,
        "--steps",
        str(args.steps),
        "--report",
        str(report),
    ]
    # megatron warns at length about missing TransformerEngine and Apex: not news here.
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)
    procs.append(proc)
    return proc, report


async def policy_version(clients: list[AsyncRolloutClient]) -> int:
    """The oldest policy version among the replicas."""
    return min([(await c.status()).policy_version for c in clients])


async def drive(
    mode: str,
    rollouts: list[str],
    trainer: subprocess.Popen,
    args,
    run: str = "",
    seed: int | None = None,
    prompts: Sequence[str] = PROMPTS,
    ahead: int = 0,
) -> None:
    """The prompt driver: each step's groups spread over the replicas, then a wait for the
    trainer's new weights before the next step. ``run`` names the groups (default: the mode);
    with ``seed`` every sample has its own sampling seed, a function of the seed, the step,
    the group and the sample (the rollout servers without chunked prefill). ``prompts``: taken
    in turn, ``groups`` per step. ``ahead``: how many steps the driver runs ahead of the
    trainer (0: on-policy by one step; k: step s is generated by the policy of step s - k, as
    an asynchronous driver would)."""
    run = run or mode
    options = SamplingOptions(temperature=1.0, max_tokens=args.max_tokens)
    clients = [AsyncRolloutClient(target) for target in rollouts]
    try:
        first = await policy_version(clients)
        for step in range(args.steps):
            if ahead:
                await wait_for_version(clients, first + step - ahead, trainer, mode)
            version = await policy_version(clients)
            chosen = [prompts[(step * args.groups + i) % len(prompts)] for i in range(args.groups)]
            groups = [f"{run}-step{step}-{i}" for i in range(args.groups)]
            seeds = None
            if seed is not None:
                seeds = [
                    seed * 10**6 + (step * args.groups + i) * args.n for i in range(len(groups))
                ]
            calls = [
                generate_all(
                    clients[r],
                    chosen[r :: len(clients)],
                    groups[r :: len(clients)],
                    args.n,
                    options,
                    seeds[r :: len(clients)] if seeds else None,
                )
                for r in range(min(len(clients), len(chosen)))
            ]
            stored = sum(await asyncio.gather(*calls))
            log(
                f"  {mode} step {step}: {stored} samples at policy version {version} on the "
                f"feed; waiting for the trainer's weights"
            )
            if not ahead:
                await wait_for_version(clients, version + 1, trainer, mode)
    finally:
        for client in clients:
            await client.close()


async def wait_for_version(clients, version: int, trainer: subprocess.Popen, mode: str) -> None:
    """Until every replica serves policy ``version`` or a later one (the trainer alive)."""
    while await policy_version(clients) < version:
        if trainer.poll() is not None:
            raise SystemExit(f"[pipeline] the {mode} trainer exited ({trainer.returncode})")
        await asyncio.sleep(0.5)


async def generate_all(client, prompts, groups, n: int, options, seeds=None) -> int:
    """One replica's share of a step; returns how many samples were stored. ``seeds``: per
    prompt, the sampling seed of its first sample, the next ones taking the next seeds, each
    sample its own request (a request's samples share its seed)."""
    if seeds is not None:
        calls = [
            generate_all(client, [prompt], [group], 1, replace(options, seed=first + j))
            for prompt, group, first in zip(prompts, groups, seeds, strict=True)
            for j in range(n)
        ]
        return sum(await asyncio.gather(*calls))
    stored = 0
    async for event in client.generate_batch(prompts, n, options, group_ids=groups):
        if isinstance(event, SampleFailed):
            raise SystemExit(f"[pipeline] {event.sample_id} failed: {event.message}")
        if isinstance(event, SampleDone):
            stored += event.stored
    return stored


async def reset_weights(rollouts: list[str], model_dir: str) -> int:
    """Every replica back on the initial weights (a new policy version)."""
    versions = []
    for target in rollouts:
        async with AsyncRolloutClient(target) as client:
            versions.append((await client.update_weights(model_dir)).policy_version)
    return min(versions)


def run_mode(
    mode: str,
    cache: str,
    rollouts: list[str],
    model_dir: str,
    args,
    procs,
    run: str = "",
    overrides: Sequence[str] = (),
    seed: int | None = None,
    prompts: Sequence[str] = PROMPTS,
    ahead: int = 0,
) -> list:
    """The RL loop in ``mode``; returns the trainer's per-step reports (``run``,
    ``overrides``: ``start_trainer``'s; ``seed``, ``prompts``, ``ahead``: ``drive``'s)."""
    trainer, report = start_trainer(mode, cache, rollouts, model_dir, args, procs, run, overrides)
    asyncio.run(drive(mode, rollouts, trainer, args, run, seed, prompts, ahead))
    if trainer.wait() != 0:
        raise SystemExit(f"[pipeline] the {mode} trainer failed ({trainer.returncode})")
    procs.remove(trainer)
    return reports_from_json(json.loads(report.read_text()))


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def preflight(args) -> None:
    """Refuse, before any process starts, what would otherwise fail later and less clearly."""
    if args.model and args.model_family != DEFAULT_FAMILY:
        raise SystemExit(
            f"[pipeline] --model-family {args.model_family} picks an embedded tiny model; with "
            "--model the checkpoint's config.json says its family: give one or the other"
        )
    if args.model and args.realistic_margins:
        raise SystemExit(
            "[pipeline] --realistic-margins shapes the embedded tiny model's routers; it does "
            "not apply to --model"
        )
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise SystemExit(
            f"[pipeline] --model {args.model}: no Hugging Face checkpoint there (no "
            "config.json); name a local MoE checkpoint folder, or leave --model out for the "
            "embedded tiny model"
        )
    ports = {"--cache-port": args.cache_port, "--rollout-port": args.rollout_port}
    for flag, port in ports.items():
        if port and port_taken(port):
            raise SystemExit(
                f"[pipeline] {flag} {port}: the port is taken by another process; pick "
                "another, or 0 for a free one"
            )
    if args.cache_port and args.cache_port == args.rollout_port:
        raise SystemExit("[pipeline] --cache-port and --rollout-port must differ")
    if args.redis_url:
        # The URL may hold a password: show only where it points.
        shown = urlsplit(args.redis_url).netloc.rpartition("@")[2]
        try:
            redis.Redis.from_url(args.redis_url, socket_connect_timeout=3, socket_timeout=3).ping()
        except (redis.RedisError, ValueError) as exc:
            raise SystemExit(
                f"[pipeline] --redis-url (host {shown!r}): cannot reach Redis ({exc}); start "
                "it, correct the URL, or leave --redis-url out for the embedded server"
            ) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO group size)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per sample")
    parser.add_argument("--model", default="", help="a local HF MoE checkpoint (default: tiny)")
    parser.add_argument(
        "--model-family",
        default=DEFAULT_FAMILY,
        choices=tuple(FAMILIES),
        help="family of the embedded tiny model",
    )
    parser.add_argument(
        "--realistic-margins",
        action="store_true",
        help="embedded tiny model with a trained model's narrow router margins",
    )
    parser.add_argument("--out", type=Path, default=Path("results"), help="report folder")
    parser.add_argument("--trainer-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--layout",
        default="dp2",
        choices=sorted(TRAINER_LAYOUTS),
        help="the trainer's parallel sizes (2 processes; 1 for 'single')",
    )
    parser.add_argument("--steps", type=int, default=3, help="RL steps per mode")
    parser.add_argument("--groups", type=int, default=2, help="GRPO groups (prompts) per step")
    parser.add_argument(
        "--redis-url", default="", help="Redis for the route cache (default: an embedded server)"
    )
    parser.add_argument("--cache-port", type=int, default=0, help="route cache port (0: free)")
    parser.add_argument("--rollout-port", type=int, default=0, help="rollout port (0: free)")
    return parser.parse_args(argv)


@contextlib.contextmanager
def timed(stages: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall time to ``stages`` under ``name`` (when it succeeds)."""
    t0 = time.perf_counter()
    yield
    stages[name] = time.perf_counter() - t0


def model_folder(args: argparse.Namespace) -> str:
    """The checkpoint the services and the trainer load: ``--model``, or the embedded tiny
    model of ``--model-family`` (built once into the temporary folder)."""
    if args.model:
        return args.model
    tiny = Path(tempfile.gettempdir()) / "router-replay-tiny-moe"
    if args.model_family != DEFAULT_FAMILY or args.realistic_margins:
        margins = "-realistic" if args.realistic_margins else ""
        tiny = tiny.with_name(f"{tiny.name}-{args.model_family}{margins}")
        if not (tiny / "config.json").is_file():
            spread = REALISTIC_ROUTER_SPREAD if args.realistic_margins else None
            build_tiny_model(tiny, family=args.model_family, router_spread=spread)
    return str(tiny)


def start_services(args: argparse.Namespace, model_dir: str, procs: list) -> tuple[str, str]:
    """The route cache, then the rollout server writing to it; returns their addresses."""
    redis_args = ["--redis-url", args.redis_url] if args.redis_url else []
    where = "Redis at --redis-url" if args.redis_url else "embedded Redis"
    cache = start("route_cache", redis_args, f"the route cache ({where})", procs, args.cache_port)
    model = ["--model", args.model] if args.model else ["--tiny-model-dir", model_dir]
    rollout_target = start(
        "rollout_server",
        ["--route-cache", cache, *model],
        "the rollout server (vLLM on the CPU)",
        procs,
        args.rollout_port,
    )
    return cache, rollout_target


def read_back(cache: str, done: list, streamed: int, stages: dict[str, float]) -> None:
    """The generated records read back in one batch, every route checked, and described."""
    with timed(stages, "batch read"), RouteCacheClient(cache) as client:
        records = list(client.read_batch([d.sample_id for d in done]))
        stored_bytes = sum(client.stat(r.sample_id).stored_bytes for r in records)
    for record in records:
        check_routes(record.routes, record.geometry, record.num_tokens - 1)
    geometry = records[0].geometry
    tokens = sum(r.num_tokens for r in records)
    generated = sum(int(t.num_generated) for r in records for t in r.turns)
    multi = max(records, key=lambda r: len(r.turns))
    log(
        f"model {geometry.model_id}: MoE layers {list(geometry.moe_layers)} (dense layers "
        f"dropped), top-{geometry.topk} of {geometry.num_experts} experts"
    )
    log(
        f"{len(records)} records read back in one batch, every route valid; {tokens} "
        f"tokens ({generated} generated, {streamed} streamed as deltas)"
    )
    log(
        f"{multi.sample_id} has {len(multi.turns)} turns, rows match tokens one for one: "
        f"{multi.num_rows} rows for {multi.num_tokens} tokens"
    )
    route_bytes = sum(r.routes.nbytes for r in records)
    log(
        f"route bytes per token {route_bytes / tokens:.1f} (uint8); stored bytes per token "
        f"{stored_bytes / tokens:.1f} (routes, tokens, log-probs, metadata)"
    )


def rl_loops(
    args: argparse.Namespace,
    cache: str,
    rollouts: list[str],
    model_dir: str,
    procs: list,
    stages: dict[str, float],
) -> dict[str, list]:
    """The RL loop in every mode, each from the initial weights; its reports per mode."""
    reports = {}
    for i, mode in enumerate(MODES):
        with timed(stages, f"RL loop {mode}"):
            version = asyncio.run(reset_weights(rollouts, model_dir)) if i else 0
            log(
                f"RL loop in mode {mode} ({args.trainer_dtype}, {args.layout}, "
                f"{args.steps} steps) from the initial weights, policy {version}"
            )
            reports[mode] = run_mode(mode, cache, rollouts, model_dir, args, procs)
    return reports


def write_report(args: argparse.Namespace, reports: dict[str, list], stages: dict[str, float]):
    """The modes side by side on the console, in ``report.json`` and its figure."""
    log("training against the rollout (natural routing vs replayed, same step):")
    for mode in MODES:
        for line in mode_lines(mode, reports[mode]):
            print(line, flush=True)
    as_json = {mode: [r.as_dict() for r in steps] for mode, steps in reports.items()}
    (args.out / "report.json").write_text(json.dumps(as_json, indent=2))
    log(f"figure: {figure(reports, args.out / 'report.png')}; data: {args.out / 'report.json'}")
    log("time per stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preflight(args)
    args.out.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    stages: dict[str, float] = {}
    try:
        with timed(stages, "start services"):
            model_dir = model_folder(args)
            cache, rollout_target = start_services(args, model_dir, procs)
        with timed(stages, "generate + store"):
            log(f"generating {len(PROMPTS)} prompts x {args.n} samples, streaming tokens")
            done, streamed = asyncio.run(rollout(rollout_target, args.n, args.max_tokens))
        read_back(cache, done, streamed, stages)
        # One replica here; the driver spreads over any number.
        reports = rl_loops(args, cache, [rollout_target], model_dir, procs, stages)
        write_report(args, reports, stages)
    finally:
        for proc in reversed(procs):
            stop_process(proc)
    log("done")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
