from __future__ import annotations

import numpy as np
import pytest

from routereplay.dev.synthetic import synthetic_record
from routereplay.domain.record import Geometry
from routereplay.domain.record_file import load_records, save_records
from routereplay.errors import InvalidArgument


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
def test_round_trip(tmp_path, suffix):
    rng = np.random.default_rng(0)
    records = [
        synthetic_record("a", Geometry((1, 2), 2, 8, "m"), 40, rng, group_id="g"),
        synthetic_record("b", Geometry((0, 5), 3, 300, "wide"), 7, rng),  # uint16
    ]
    got = load_records(save_records(tmp_path / f"r{suffix}", records))
    for a, b in zip(got, records, strict=True):
        assert (a.sample_id, a.group_id, a.geometry) == (b.sample_id, b.group_id, b.geometry)
        assert a.routes.dtype == b.routes.dtype
        np.testing.assert_array_equal(a.routes, b.routes)
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.turns[0].logprobs, b.turns[0].logprobs)


def test_bad_files_are_refused(tmp_path):
    with pytest.raises(InvalidArgument, match=".npz or .pt"):
        save_records(tmp_path / "r.json", [])
    np.savez(tmp_path / "other.npz", meta=np.frombuffer(b'{"format": "x"}', np.uint8))
    with pytest.raises(InvalidArgument, match="format 'x'"):
        load_records(tmp_path / "other.npz")
