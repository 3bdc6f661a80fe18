"""The scaling model's arithmetic against figures worked out by hand."""

import json
import math
from dataclasses import replace

import pytest

from benchmarks.performance.scaling_model import (
    DEFAULT_MEASURED,
    MIB,
    MODELS,
    Fleet,
    Measured,
    load_measured,
    main,
    scale,
)

MEASURED = Measured(cache_write=150, cache_read=160, redis_write=1500, redis_read=400, source="")


def test_qwen3_fleet_by_hand():
    qwen3 = MODELS[0]
    assert qwen3.geometry.model_id == "Qwen3-30B-A3B" and qwen3.tokens_per_s == 5000
    r = scale(qwen3, Fleet(), MEASURED)
    # 48 MoE layers x top-8, one byte per id; 64 GPUs x 5,000 tokens/s.
    assert r["bytes_per_token"] == 384
    assert r["fleet_tokens_per_s"] == 320_000
    assert r["write_bytes_per_s"] == 122_880_000  # 117.1875 MiB/s
    # Stage reads: 4 stages of 12 layers, each read once per DP rank: 1x, 4 calls a record.
    assert (r["fetch_fanout"], r["fetch_calls_per_record"]) == (1, 4)
    assert r["read_bytes_per_s"] == r["write_bytes_per_s"]
    assert r["fetch_fanout_whole"] == 16  # TP4 x PP4 x CP1 ranks fetch each whole record
    assert r["read_bytes_per_s_whole"] / MIB == pytest.approx(1875.0)
    assert r["record_bytes"] == 12_582_912  # 32768 x 384
    assert r["step_s"] == pytest.approx(104.8576)  # 1024 x 32768 / 320,000
    # 2 x (117.1875 / 150 + 117.1875 / 160) = 3.03 -> 4 replicas; 2 x (117.1875 / 1500 +
    # 117.1875 / 400) = 0.74 -> 1 shard.
    assert (r["cache_replicas"], r["redis_shards"]) == (4, 1)
    # Whole reads by every rank: 2 x (117.1875 / 150 + 1875 / 160) = 2 x 12.5 = 25 replicas;
    # 2 x (117.1875 / 1500 + 1875 / 400) = 9.53 -> 10 shards.
    assert (r["cache_replicas_whole"], r["redis_shards_whole"]) == (25, 10)
    # 256 GPUs / 16 = 16 DP ranks, 1024 / 16 = 64 samples each: 64 records' 12 of 48 layers.
    assert (r["dp"], r["rank_samples"], r["stage_layers"]) == (16, 64, 12)
    assert r["rank_fetched_bytes"] == 192 * MIB
    # 64 x 32768 / TP4 = 524,288 local tokens x 12 layers (48 / PP4) x 8.
    assert r["rank_int16_bytes"] == 96 * MIB
    assert r["rank_int64_bytes"] == 384 * MIB
    assert r["rank_fetch_s"] == pytest.approx(1.2)  # 192 MiB at 160 MiB/s
    # A slower layer-selected read counts for stage reads: 2 x (117.1875 / 150 + 117.1875 /
    # 40) = 7.4 -> 8 replicas, and 192 MiB at 40 MiB/s.
    slow = scale(qwen3, Fleet(), replace(MEASURED, cache_stage_read=40))
    assert (slow["cache_replicas"], slow["rank_fetch_s"]) == (8, pytest.approx(4.8))


def test_deepseek_uneven_stages_and_other_fleet():
    deepseek = MODELS[1]
    fleet = Fleet(rollout_gpus=8, trainer_gpus=64, global_batch=100, tp=2, pp=4, cp=2, headroom=1.0)
    r = scale(deepseek, fleet, MEASURED)
    assert r["bytes_per_token"] == 464  # 58 MoE layers x 8
    assert r["write_bytes_per_s"] == pytest.approx(8 * 1850 * 464)
    assert r["fetch_fanout_whole"] == 16 and r["dp"] == 4
    assert (r["fetch_fanout"], r["fetch_calls_per_record"], r["stage_layers"]) == (1, 4, 15)
    assert r["rank_samples"] == 25
    # 25 x 32768 / CP2 / TP2 = 204,800 tokens x ceil(58 / 4) = 15 layers x 8 x 2 bytes.
    assert r["rank_int16_bytes"] == 204_800 * 15 * 8 * 2
    load = 8 * 1850 * 464 / MIB * (1 / 150 + 16 / 160)
    assert r["cache_replicas_whole"] == int(load) + 1
    assert r["cache_replicas"] == math.ceil(8 * 1850 * 464 / MIB * (1 / 150 + 1 / 160))


def test_measured_from_results_prefers_full_size_rows(tmp_path):
    assert load_measured(tmp_path) == DEFAULT_MEASURED
    row = {
        "service_raw_write_mibs": 1.0,
        "service_raw_read_mibs": 2.0,
        "redis_write_mibs": 3.0,
        "redis_read_mibs": 4.0,
    }
    rows = [
        {**row, "tokens": 4096, "service_raw_write_mibs": 999.0},
        {**row, "tokens": 32768, "service_raw_write_mibs": 100.0},
        {**row, "tokens": 32768, "service_raw_write_mibs": 200.0},
    ]
    (tmp_path / "route_cache.json").write_text(json.dumps({"results": rows}))
    m = load_measured(tmp_path)
    assert (m.cache_write, m.cache_read, m.redis_write, m.redis_read) == (150.0, 2.0, 3.0, 4.0)
    assert m.stage_read == 2.0  # results without a layer-selected read: the whole read's
    rows = [{**r, "service_raw_stage_read_mibs": 5.0} for r in rows]
    (tmp_path / "route_cache.json").write_text(json.dumps({"results": rows}))
    assert load_measured(tmp_path).stage_read == 5.0


def test_command_line_overrides(tmp_path):
    out = main(
        [
            "--results",
            str(tmp_path),
            "--no-write",
            "--rollout-gpus",
            "2",
            "--tokens-per-s",
            "10",
            "20",
        ]
    )
    assert [m["fleet_tokens_per_s"] for m in out["models"]] == [20, 40]
    assert out["measured"]["source"] == DEFAULT_MEASURED.source


def test_the_measured_stage_read_fanout_carries_to_the_fleet(tmp_path):
    layouts = {
        "TP2+SP": {"stage_ratio": 1.0, "whole_ratio": 2.0},
        "TP2+SP x PP2": {"stage_ratio": 1.03, "whole_ratio": 4.0},
    }
    (tmp_path / "layout_reads.json").write_text(json.dumps({"layouts": layouts}))
    m = load_measured(tmp_path)
    assert m.stage_fanout == 1.03 and "2 trainer layouts" in m.fanout_source
    assert (m.cache_write, m.cache_read) == (
        DEFAULT_MEASURED.cache_write,
        DEFAULT_MEASURED.cache_read,
    )
    r = scale(MODELS[0], Fleet(), m)
    assert r["fetch_fanout"] == 1.03
    assert r["read_bytes_per_s"] == pytest.approx(1.03 * r["write_bytes_per_s"])
