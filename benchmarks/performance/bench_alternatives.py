"""How in-process RL frameworks move routes, against this project's codec, on the same data.

Frameworks pass a batch's routes as an int32 or int16 torch tensor through an object store
(pickle or ``torch.save``). For one batch (8 samples x 4K tokens, Zipf-like routes) of each
geometry, in the same run: serialize + deserialize time and bytes for each form, this
project's codec (RAW and per-layer ZSTD) with its checksum, and a plain memory copy of the
uint8 bytes as the floor. Bytes per token are set beside the information limit
(L x log2 C(E, k) bits: any top-k set of k distinct experts among E) and the empirical
entropy of the measured routes (k x each layer's entropy of expert frequencies, which bounds
the entropy of the sets from above).

Usage: python -m benchmarks.performance.bench_alternatives [--quick]
"""

from __future__ import annotations

import argparse
import io
import math
import pickle
import sys

import numpy as np
import torch

from benchmarks.common import machine, median_time, write_section
from routereplay.dev.synthetic import DEEPSEEK_V3, QWEN3_30B_A3B, synthetic_routes
from routereplay.domain.codec import Encoding, decode_routes
from routereplay.domain.route_stats import expert_load
from tests.support.records import encode_routes

MIB = 2**20


def torch_save_round_trip(tensor: torch.Tensor) -> int:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    size = buffer.tell()
    buffer.seek(0)
    torch.load(buffer, weights_only=True)
    return size


def pickle_round_trip(tensor: torch.Tensor) -> int:
    data = pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL)
    pickle.loads(data)
    return len(data)


def codec_round_trip(blocks: list[np.ndarray], geometry, encoding: Encoding) -> int:
    size = 0
    for routes in blocks:
        encoded = encode_routes(routes, encoding)
        decode_routes(encoded, geometry)
        size += len(encoded.data)
    return size


def bench(geometry, samples: int, tokens: int, repeats: int, rng) -> list[dict]:
    blocks = [synthetic_routes(geometry, tokens - 1, rng, skew=1.0) for _ in range(samples)]
    batch = np.stack(blocks)  # [B, T - 1, L, k], as a framework's padded batch tensor
    rows = batch.shape[0] * batch.shape[1]
    raw = batch.nbytes
    as_int32 = torch.from_numpy(batch.astype(np.int32))
    as_int16 = torch.from_numpy(batch.astype(np.int16))
    cases = {
        "memcpy of the uint8 bytes (floor)": lambda: (batch.copy(), raw)[1],
        "int32 tensor, torch.save + load": lambda: torch_save_round_trip(as_int32),
        "int32 tensor, pickle": lambda: pickle_round_trip(as_int32),
        "int16 tensor, torch.save + load": lambda: torch_save_round_trip(as_int16),
        "int16 tensor, pickle": lambda: pickle_round_trip(as_int16),
        "codec RAW (checksummed)": lambda: codec_round_trip(blocks, geometry, Encoding.RAW),
        "codec ZSTD per layer (checksummed)": lambda: codec_round_trip(
            blocks, geometry, Encoding.ZSTD
        ),
    }
    results = []
    for name, fn in cases.items():
        size = fn()
        seconds = median_time(fn, repeats)
        results.append(
            {
                "geometry": geometry.model_id,
                "form": name,
                "bytes": size,
                "bytes_per_token": size / rows,
                "seconds": seconds,
                "mib_per_s": raw / seconds / MIB,
            }
        )
    floor = results[0]["seconds"]
    for r in results:
        r["x_memcpy"] = r["seconds"] / floor
    layers, k, experts = geometry.num_moe_layers, geometry.topk, geometry.num_experts
    limit = layers * math.log2(math.comb(experts, k)) / 8
    load = expert_load(batch.reshape(-1, layers, k), experts).astype(np.float64)
    p = load / load.sum(axis=1, keepdims=True)
    entropy_bits = -(np.where(p > 0, p * np.log2(np.where(p > 0, p, 1)), 0.0)).sum(axis=1)
    empirical = float((k * entropy_bits).sum() / 8)
    for r in results:
        r["limit_bytes_per_token"] = limit
        r["empirical_bytes_per_token"] = empirical
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| geometry | form | bytes/token | round trip ms | x memcpy | MiB/s of uint8 routes |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['geometry']} | {r['form']} | {r['bytes_per_token']:.0f} | "
            f"{r['seconds'] * 1e3:.1f} | {r['x_memcpy']:.1f} | {r['mib_per_s']:.0f} |"
        )
    limits = {r["geometry"]: r for r in results}
    lines.append("")
    for name, r in limits.items():
        lines.append(
            f"- {name}: information limit {r['limit_bytes_per_token']:.0f} B/token "
            f"(log2 C(E, k) bits per layer); these routes' empirical entropy at most "
            f"{r['empirical_bytes_per_token']:.0f} B/token."
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 samples of 1K tokens, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.tokens, args.repeats = 2, 1024, 2
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    results = []
    for geometry in (QWEN3_30B_A3B, DEEPSEEK_V3):
        results += bench(geometry, args.samples, args.tokens, args.repeats, rng)
    markdown = (
        "## Against the alternatives: a batch's routes in and out of bytes\n\n"
        f"`python -m benchmarks.performance.bench_alternatives` ({machine()}; torch "
        f"{torch.__version__}, "
        f"one thread): {args.samples} samples x {args.tokens} tokens of Zipf-like routes, "
        f"{args.repeats} repeats, medians. Round trip = serialize + deserialize (the codec "
        "also computes and verifies its checksum). x memcpy: against a plain copy of the "
        "same uint8 bytes in the same run.\n\n" + table(results)
    )
    if not args.quick:
        write_section("alternatives", markdown, {"machine": machine(), "results": results})
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
