"""verl's replay functions on real gloo groups, fed by the integration: TP2 + sequence parallel
and PP2 (megatron's schedule), 2 ranks launched with torchrun (``tests/verl/multirank.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from routereplay.dev.hf_rollout import random_prompts, rollout_records
from routereplay.domain.record_file import save_records
from routereplay.rpc.client import RouteCacheClient
from tests.verl.cpu import needs_verl
from tests.verl.helpers import geometry_of, token_output, torchrun
from verl_integration.rollout import TurnWriter

needs_verl()
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def records_file(tiny_model_dir, route_cache, tmp_path_factory):
    """4 samples of 10 and 13 tokens (an odd length: TP2 pads it in the pack) written through
    the rollout seam; the same records in a file, the workers' oracle."""
    prompts = random_prompts(2, [5, 8], 512, seed=11)
    records = rollout_records(
        tiny_model_dir, prompts, group_size=2, new_tokens=5, seed=2, prefix="verl-mr"
    )
    with RouteCacheClient(route_cache) as client:
        writer = TurnWriter(client, geometry_of(tiny_model_dir))
        for r in records:
            start = r.turns[0].generated_start
            writer.write(r.sample_id, r.token_ids[:start].tolist(), token_output(r, start))
    return save_records(tmp_path_factory.mktemp("verl-mr") / "records.npz", records)


def _results(out) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


# 4 samples of 10, 10, 13, 13 tokens: every token but the last replayed, per MoE layer.
ROWS = 9 + 9 + 12 + 12


def test_tp2_sp_each_rank_replays_its_sequence_share(
    tiny_model_dir, records_file, route_cache, tmp_path
):
    out = tmp_path / "tp2sp"
    proc = torchrun("tp2sp", tiny_model_dir, records_file, route_cache, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = _results(out)
    for r in ranks:
        assert not r["bad"], r
        assert r["router_layers"] == [1, 2, 3]
    # verl's scatter split the pack between the ranks; together they cover every row.
    assert sum(r["replayed"] for r in ranks) == 3 * ROWS
    assert sum(r["natural"] for r in ranks) == 3 * 4
    assert ranks[0]["rows"][1] == ranks[1]["rows"][0]
    # One read per TP group: rank 0 read the route cache, rank 1 got the bytes over gloo.
    assert [r["read_from_cache"] for r in ranks] == [True, False]


def test_pp2_each_stage_fetches_and_replays_only_its_layers(
    tiny_model_dir, records_file, route_cache, tmp_path
):
    out = tmp_path / "pp2"
    proc = torchrun("pp2", tiny_model_dir, records_file, route_cache, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = _results(out)
    for r in ranks:
        assert not r["bad"], r
        assert r["read_from_cache"]
        assert r["read_layers"] == r["router_layers"]
        assert not r["other_stage_columns_nonzero"]
    assert [r["router_layers"] for r in ranks] == [[1], [2, 3]]
    assert [r["replayed"] for r in ranks] == [ROWS, 2 * ROWS]
