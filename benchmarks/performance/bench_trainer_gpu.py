"""Replay on a GPU: what router replay costs on the trainer's accelerator, in bf16.

One run measures, on the same weights and batches (``--device cuda``; the same code runs on the
CPU with ``--device cpu --tiny``, which a test runs in CI):

1. **Replay overhead**: a training step (forward + backward) with R3 replay against
   ``disabled``, medians of alternating repeats. R3 replays the model's own natural routes
   (recorded in a first pass), so both sides do identical expert work and the difference is
   replay's own cost: alignment (records -> replay ids), megatron's ``RouterReplay`` hook with
   the trainer's mask (``trainer.model.replay.MaskedRouterReplay``, whose routers widen the
   host's int16 ids to int64 on the device, one copy per router), the ``REPLAY_BACKWARD``
   bookkeeping. A third side, ``R3, ids on device``, copies every router's ids to the device
   before the step, to show what the per-router copies cost.
2. **Alignment** alone, and the **replay ids' host-to-device copy** alone (every router's ids
   of the micro-batch, as the trainer holds them: int16 on the host).
3. **Replay checked**: every replayed router row uses exactly the recorded experts (megatron's
   routing map against the record: the check of
   ``tests/trainer/model/test_replay.py::test_forced_routes_are_followed_and_masked_rows_route_natively``),
   rows without a route route natively, for the natural routes the timing replays and for
   random forced routes (which differ from the natural ones). The script fails if any row
   differs.
4. **Fetch hidden behind the step**: batches read from a ``RouteCacheServer`` over an embedded
   valkey on the same machine (``read_batch``, the trainer's ``CacheSource``) through the
   trainer's ``Prefetcher``, with prefetch on and off; per batch the fetch, the loop's wait
   for it, alignment + copy + replayed step. The loop's wait as a share of the step is the
   figure (target: at most 1%).

The model is a Qwen3-MoE built by megatron-core with its local (non-TransformerEngine) layers
and initialised from a seed (no checkpoint is read: only ``config.json`` is written), every
layer MoE. ``--device cuda`` size: 8 layers, hidden 2048, 32 query heads of 128 and 4 KV heads,
64 experts of width 768, top-8, vocabulary 32768: about 2.7 B parameters (Qwen3-30B-A3B's
layer widths with half its experts), 5.4 GB in bf16; two copies (``disabled`` and replay) with
their bf16 gradients and the activations of one micro-batch of 4 x 1024 tokens take about
35 GB, within one 80 GB GPU. ``--tiny``: the test model's sizes (hidden 128, 8 experts top-2).

Usage:
    python -m benchmarks.performance.bench_trainer_gpu --device cuda            # on the GPU machine
    python -m benchmarks.performance.bench_trainer_gpu --device cpu --tiny      # anywhere (CI)

It prints a table and writes the results as JSON (``--json``; default ``$OUT/trainer_gpu.json``
where ``OUT`` is set, else ``results/trainer_gpu.json``); ``--write`` also replaces the
``trainer_gpu`` section of docs/benchmarks.md. ``tools/gpu_bench.sh`` is the GPU machine's one
prepared command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from routereplay.families.base import TINY_SIZE, MoESize
from tests.support.replay import recording

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Size:
    """A benchmark size: the model's, the micro-batch's (sample lengths) and the run's."""

    name: str
    model: MoESize
    vocab: int
    lengths: tuple[int, ...]
    repeats: int
    batches: int


# Qwen3-30B-A3B's layer widths (hidden 2048, 32 x 128 query heads, 4 KV heads, experts of
# width 768, top-8) with 64 experts and 8 layers, every one MoE: a step is seconds of real GPU
# work, not launch overhead alone, and two copies fit one 80 GB GPU (docstring).
GPU = Size(
    name="gpu",
    model=MoESize(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=64,
        num_experts_per_tok=8,
    ),
    vocab=32768,
    lengths=(1024, 1024, 1000, 1024),  # one micro-batch of 4072 tokens, right padding
    repeats=20,
    batches=10,
)
# The tests' tiny model (hidden 128, 4 layers, 8 experts top-2): seconds on one CPU thread.
TINY = Size(
    name="tiny",
    model=TINY_SIZE,
    vocab=512,
    lengths=(40, 33, 28, 40),
    repeats=3,
    batches=4,
)


class Clock:
    """Wall time of work on ``device``: waits for the device's queue before reading the time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def write_config(out: Path, size: Size) -> Path:
    """A Qwen3-MoE ``config.json`` of ``size``, every layer MoE (no weights: the model is
    initialised from a seed)."""
    from routereplay.dev.tiny_model import family_config

    out.mkdir(parents=True, exist_ok=True)
    config = family_config(
        "qwen3_moe",
        size.model,
        {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1},
    )
    config.vocab_size = size.vocab
    config.mlp_only_layers = []
    config.max_position_embeddings = max(2048, max(size.lengths))
    config.to_json_file(str(out / "config.json"))
    return out


def build_pair(model_dir: Path, groups, device: torch.device, dtype: torch.dtype):
    """The same weights built twice: without replay (``disabled``) and with it (R3)."""
    from trainer.model.build import build_model

    overrides = {"params_dtype": dtype, "bf16": dtype == torch.bfloat16}
    torch.manual_seed(0)
    kw = dict(pg_collection=groups, load_weights=False, **overrides)
    plain = build_model(model_dir, routing_replay=False, **kw)
    replay = build_model(model_dir, routing_replay=True, **kw)
    for built in (plain, replay):
        built.model.to(device)
    replay.model.load_state_dict(plain.model.state_dict())
    return plain, replay


def random_batch(size: Size, seed: int, prefix: str):
    from trainer.layout.batch import PaddedBatch

    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(2, size.vocab, (n,), generator=g).numpy() for n in size.lengths]
    ids = [f"{prefix}-{i}" for i in range(len(tokens))]
    return PaddedBatch.from_samples(ids, tokens, padding_side="right", pad_id=1)


class Inputs:
    """A batch's model inputs on the device."""

    def __init__(self, batch, device: torch.device):
        self.tokens = batch.token_ids.to(device)
        self.positions = batch.position_ids().to(device)
        self.mask = batch.attention_mask().to(device)


def step_loss(model, inputs: Inputs) -> torch.Tensor:
    logits = model(inputs.tokens, inputs.positions, inputs.mask)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -logp.gather(-1, inputs.tokens[:, 1:, None]).mean()


def records_of(batch, routes, geometry) -> list:
    """One single-turn record per sample: its tokens and ``routes[b]`` ``[T - 1, L, k]``."""
    from routereplay.domain.record import Record, Turn

    out = []
    for b in range(batch.batch_size):
        tokens = batch.sample_tokens(b).numpy().astype(np.int32)
        turn = Turn(token_start=0, token_end=tokens.size, generated_start=1)
        record = Record(batch.sample_ids[b], geometry, tokens, routes[b], [turn])
        record.validate()
        out.append(record)
    return out


def natural_records(replay, batch, inputs: Inputs) -> list:
    """The batch's records holding what the model's routers choose on it (megatron's RECORD)."""
    from trainer.layout.align import routes_from_recorded

    recorded: list[list[torch.Tensor]] = []
    with torch.no_grad(), replay.replay.step(), recording(replay.replay, recorded):
        step_loss(replay.model, inputs)
    return records_of(
        batch, routes_from_recorded(batch, recorded[0], replay.geometry), replay.geometry
    )


def random_records(batch, geometry, seed: int) -> list:
    """Records with distinct random experts per token and layer (not the natural ones)."""
    rng = np.random.default_rng(seed)
    routes = []
    for n in batch.lengths:
        scores = rng.random((int(n) - 1, geometry.num_moe_layers, geometry.num_experts))
        routes.append(np.argsort(scores, axis=-1)[..., : geometry.topk].astype(geometry.dtype))
    return records_of(batch, routes, geometry)


def check_replay(replay, batch, inputs: Inputs, records: list) -> dict:
    """Replay ``records`` in one forward + backward and compare, per router, the experts its
    routing map used with the record on every replayed row, and with its natural top-k
    (megatron's own, on the same scores) on every other row.

    Returns:
        ``rows`` (replayed rows compared, over routers), ``mismatched`` (of those),
        ``native_rows`` / ``native_mismatched`` (rows without a route), ``changed`` (replayed
        rows whose record differs from the natural choice: replay changed the routing there).
    """
    from trainer.layout.align import align_routes

    control = replay.replay
    aligned = align_routes(batch, records, replay.geometry, control.layers)
    rows = aligned.replayed.reshape(-1)
    observed: dict[int, dict[str, torch.Tensor]] = {}
    replay.model.zero_grad(set_to_none=True)
    with control.step():
        with control.observe(observed), control.forward(aligned.indices):
            loss = step_loss(replay.model, inputs)
        with control.backward():
            loss.backward()
    out = {"rows": 0, "mismatched": 0, "native_rows": 0, "native_mismatched": 0, "changed": 0}
    for j, layer in enumerate(control.layers):
        used = observed[layer]["used"].cpu().sort(dim=-1).values
        natural = observed[layer]["natural"].cpu().sort(dim=-1).values
        want = aligned.indices[j].long().sort(dim=-1).values
        same = (used == want).all(dim=-1)
        out["rows"] += int(rows.sum())
        out["mismatched"] += int((~same[rows]).sum())
        native_same = (used == natural).all(dim=-1)[~rows]
        out["native_rows"] += int((~rows).sum())
        out["native_mismatched"] += int((~native_same).sum())
        out["changed"] += int((~(want == natural).all(dim=-1))[rows].sum())
    replay.model.zero_grad(set_to_none=True)
    return out


def time_replay(plain, replay, batch, inputs: Inputs, records: list, clock: Clock, repeats: int):
    """Seconds per repeat of each side, in alternation (see the module docstring)."""
    from trainer.layout.align import align_routes

    control = replay.replay
    device = inputs.tokens.device

    def align():
        return align_routes(batch, records, replay.geometry, control.layers)

    def replayed_step(indices):
        with control.step():
            with control.forward(indices):
                loss = step_loss(replay.model, inputs)
            with control.backward():
                loss.backward()

    def run_disabled():
        plain.model.zero_grad(set_to_none=True)
        step_loss(plain.model, inputs).backward()

    def run_r3():
        replay.model.zero_grad(set_to_none=True)
        replayed_step(align().indices)

    def run_r3_device():
        replay.model.zero_grad(set_to_none=True)
        replayed_step([t.to(device) for t in align().indices])

    host_ids = align().indices

    def copy_ids():
        return [t.to(device) for t in host_ids]

    sides = [
        ("disabled", run_disabled),
        ("R3", run_r3),
        ("R3_ids_on_device", run_r3_device),
        ("align", align),
        ("h2d_copy", copy_ids),
    ]
    for _ in range(2):  # warm-up: allocator, cuBLAS handles, kernels
        run_disabled(), run_r3(), run_r3_device()
    times: dict[str, list[float]] = {name: [] for name, _ in sides}
    for i in range(repeats):
        # Alternate which side runs first, so slow drifts of the machine cancel.
        for name, fn in sides if i % 2 == 0 else sides[2::-1] + sides[3:]:
            times[name].append(clock.time(fn))
    plain.model.zero_grad(set_to_none=True)
    replay.model.zero_grad(set_to_none=True)
    ids_bytes = sum(t.numel() * t.element_size() for t in host_ids)
    return times, ids_bytes


def fetch_loop(replay, size: Size, records: list, clock: Clock, batches: int) -> dict:
    """Per batch, the route cache fetch (in the background with prefetch), the loop's wait for
    it, alignment, the copy to the device and the replayed forward + backward; prefetch on and
    off. Each batch is ``records`` under new sample ids, written first."""
    from benchmarks.common import batch_copies
    from route_cache.config import Config
    from route_cache.connection import connect
    from route_cache.embedded import start_embedded_redis
    from route_cache.server import RouteCacheServer
    from route_cache.store import RouteStore
    from trainer.data.source import CacheSource, Prefetcher
    from trainer.layout.align import align_routes
    from trainer.layout.batch import PaddedBatch

    control = replay.replay
    device = next(replay.model.parameters()).device
    valkey, url = start_embedded_redis()
    client = connect(url, cluster=False)
    server = RouteCacheServer(
        Config(host="127.0.0.1", port=0, grace_s=1), RouteStore(client, ttl_ms=600_000)
    ).start()
    source = CacheSource(f"127.0.0.1:{server.port}")
    out: dict = {
        "batches": batches,
        "tokens": int(sum(r.token_ids.size for r in records)),
        "route_bytes": int(sum(r.routes.nbytes for r in records)),
    }
    try:
        for prefetch in ("on", "off"):
            plans = batch_copies(source.client, records, batches, prefetch)
            rows: list[dict] = []
            for fetched in Prefetcher(source, plans, missing="error", prefetch=prefetch == "on"):
                clock.sync()
                start = time.perf_counter()
                batch = PaddedBatch.from_samples(
                    [s.sample_id for s in fetched.samples],
                    [s.token_ids for s in fetched.samples],
                    padding_side="right",
                    pad_id=1,
                )
                aligned = align_routes(batch, fetched.records, replay.geometry, control.layers)
                aligned_at = time.perf_counter()
                inputs = Inputs(batch, device)
                indices = [t.to(device) for t in aligned.indices]
                replay.model.zero_grad(set_to_none=True)
                with control.step():
                    with control.forward(indices):
                        loss = step_loss(replay.model, inputs)
                    with control.backward():
                        loss.backward()
                clock.sync()
                end = time.perf_counter()
                rows.append(
                    {
                        "fetch": fetched.fetch_s,
                        "wait": fetched.wait_s,
                        "align": aligned_at - start,
                        "step": end - start,
                    }
                )
            replay.model.zero_grad(set_to_none=True)
            # The first batch has nothing to hide behind.
            later = rows[1:] or rows
            out[prefetch] = {k: statistics.median(r[k] for r in later) for k in later[0]}
            out[prefetch]["wait_share"] = out[prefetch]["wait"] / out[prefetch]["step"]
    finally:
        source.close()
        server.stop(0)
        client.close()
        valkey.stop()
    return out


def describe(device: torch.device) -> dict:
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": version("megatron-core"),
        "grpcio": version("grpcio"),
        "redis": version("redis"),
    }
    if device.type == "cuda":
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30)
    return out


def markdown(r: dict) -> str:
    med, fetch, checks = r["median_s"], r["fetch"], r["replay_checks"]
    env = r["environment"]
    on, off = fetch["on"], fetch["off"]
    base = med["disabled"]
    command = f"python -m benchmarks.performance.bench_trainer_gpu --device {r['device']}"
    command += " --tiny" if r["size"] == "tiny" else ""
    copy = f"replay ids' host-to-device copy alone ({r['ids_bytes']} bytes, {r['routers']} routers)"
    sides = [
        ("disabled", "disabled"),
        ("R3 (align + replayed forward + backward; ids copied by each router)", "R3"),
        ("R3, ids copied to the device before the step", "R3_ids_on_device"),
        ("alignment alone (records -> replay ids)", "align"),
        (copy, "h2d_copy"),
    ]
    step_rows = "\n".join(
        f"| {label} | {med[key]:.5f} | {med[key] / base * 100:.2f}% |" for label, key in sides
    )
    check_rows = "\n".join(
        f"| {name} | {c['rows']} | {c['mismatched']} | {c['changed']} | {c['native_rows']} | "
        f"{c['native_mismatched']} |"
        for name, c in checks.items()
    )
    fetch_rows = "\n".join(
        f"| {label} | {on[key] * scale:.{digits}f}{unit} | {off[key] * scale:.{digits}f}{unit} |"
        for label, key, scale, digits, unit in [
            ("fetch (read_batch, s)", "fetch", 1, 4, ""),
            ("loop wait (s)", "wait", 1, 5, ""),
            ("align (s)", "align", 1, 4, ""),
            ("step (s)", "step", 1, 4, ""),
            ("loop wait / step", "wait_share", 100, 2, "%"),
        ]
    )
    return f"""## Trainer on a GPU: replay overhead in {r["dtype"]}

`{command}` on {env["device"]} ({env["host"]}; torch {env["torch"]}, CUDA {env["cuda"]},
megatron-core {env["megatron_core"]}, local layers). Model: {r["model"]}; one micro-batch of
{r["tokens"]} tokens; forward + backward; medians of {r["repeats"]} alternating repeats.

| | median (s) | share of `disabled` |
|---|---|---|
{step_rows}

Replay overhead: **{r["replay_overhead"] * 100:+.2f}%** (target: at most 2%).

Replay followed, per router row (every router of the model, forward pass; mismatched must be
0): rows replayed, of them mismatched, of them where the record differs from the natural
choice (replay changed the routing there); rows without a route (native), of them mismatched.

| records | replayed rows | mismatched | changed by replay | native rows | mismatched |
|---|---|---|---|---|---|
{check_rows}

Route cache fetch ({fetch["batches"]} batches of {fetch["tokens"]} tokens, {fetch["route_bytes"]}
route bytes each, `RouteCacheServer` over an embedded valkey on the same machine, the trainer's
`CacheSource` and `Prefetcher`); medians per batch after the first; step = alignment + copy
+ replayed forward + backward:

| | prefetch on | prefetch off |
|---|---|---|
{fetch_rows}

With prefetch the loop waits **{on["wait_share"] * 100:.2f}%** of the step (target: at most 1%).
"""


def default_json() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "trainer_gpu.json" if out else ROOT / "results" / "trainer_gpu.json"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model (CI)")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="default bfloat16"
    )
    parser.add_argument("--repeats", type=int, help="alternating repeats (default per size)")
    parser.add_argument("--batches", type=int, help="route cache batches (default per size)")
    parser.add_argument("--json", type=Path, default=None, help="results file")
    parser.add_argument(
        "--write", action="store_true", help="replace docs/benchmarks.md's trainer_gpu section"
    )
    args = parser.parse_args(argv)
    size = TINY if args.tiny else GPU
    repeats = args.repeats or size.repeats
    batches = args.batches or size.batches
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device (use --device cpu --tiny)")
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1 if device.type == "cpu" else min(8, os.cpu_count() or 1))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    clock = Clock(device)

    from trainer.distributed import single_process

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "model", size)
        groups = single_process.init_single_process(f"file://{tmp}/pg", seed=0)
        try:
            plain, replay = build_pair(model_dir, groups, device, dtype)
            built_s = time.perf_counter() - started
            params = sum(p.numel() for p in plain.model.parameters())
            batch = random_batch(size, seed=0, prefix="b")
            inputs = Inputs(batch, device)
            records = natural_records(replay, batch, inputs)
            checks = {
                "natural": check_replay(replay, batch, inputs, records),
                "random": check_replay(
                    replay, batch, inputs, random_records(batch, replay.geometry, seed=1)
                ),
            }
            times, ids_bytes = time_replay(plain, replay, batch, inputs, records, clock, repeats)
            del plain
            fetch = fetch_loop(replay, size, records, clock, batches)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        finally:
            single_process.shutdown()

    med = {k: statistics.median(v) for k, v in times.items()}
    geometry = replay.geometry
    m = size.model
    results = {
        "size": size.name,
        "device": device.type,
        "dtype": args.dtype,
        "model": (
            f"Qwen3-MoE, {m.num_hidden_layers} layers (all MoE), hidden {m.hidden_size}, "
            f"{m.num_attention_heads} heads of {m.head_dim}, {m.num_experts} experts of "
            f"width {m.moe_intermediate_size} top-{m.num_experts_per_tok}, vocabulary "
            f"{size.vocab}, {params / 1e6:,.1f} M parameters"
        ),
        "parameters": params,
        "tokens": int(sum(size.lengths)),
        "routers": len(replay.routers),
        "repeats": repeats,
        "median_s": med,
        "times_s": times,
        "replay_overhead": med["R3"] / med["disabled"] - 1,
        "replay_overhead_ids_on_device": med["R3_ids_on_device"] / med["disabled"] - 1,
        "align_share": med["align"] / med["disabled"],
        "h2d_share": med["h2d_copy"] / med["disabled"],
        "ids_bytes": ids_bytes,
        "replay_checks": checks,
        "replay_followed": all(
            c["mismatched"] == 0 and c["native_mismatched"] == 0 for c in checks.values()
        ),
        "fetch": fetch,
        "build_s": built_s,
        "total_s": time.perf_counter() - started,
        "peak_gpu_memory_gib": None if peak is None else peak / 2**30,
        "geometry": {
            "moe_layers": list(geometry.moe_layers),
            "experts": geometry.num_experts,
            "topk": geometry.topk,
        },
        "environment": describe(device),
    }
    text = markdown(results)
    print(text)
    path = args.json or default_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"results: {path}")
    if args.write:
        from benchmarks.common import write_section

        write_section("trainer_gpu", text, results)
    if not results["replay_followed"]:
        print("FAILED: a replayed router row did not use the recorded experts", file=sys.stderr)
        raise SystemExit(1)
    if checks["random"]["changed"] == 0:
        print("FAILED: the random routes never differed from the natural ones", file=sys.stderr)
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
