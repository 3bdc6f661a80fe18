from __future__ import annotations

import numpy as np
import pytest

from routereplay.domain.record import (
    MASKED,
    Geometry,
    Turn,
    check_sample_id,
    check_turns,
    replay_dtype,
    route_dtype,
)
from routereplay.errors import InvalidArgument


@pytest.mark.parametrize(
    "sample_id, message",
    [("", "empty"), ("x" * 257, "257 characters"), ("a b", "printable"), ("a{b}", "braces")],
)
def test_bad_sample_ids(sample_id, message):
    with pytest.raises(InvalidArgument, match=message):
        check_sample_id(sample_id)


def test_good_sample_ids():
    for sample_id in ["a", "x" * 256, "prompt-7/sample:3@v2", "550e8400-e29b-41d4"]:
        check_sample_id(sample_id)


@pytest.mark.parametrize(
    "geometry, message",
    [
        (Geometry((), 2, 8), "moe_layers is empty"),
        (Geometry((2, 1), 2, 8), "strictly ascending"),
        (Geometry((1, 1), 2, 8), "strictly ascending"),
        (Geometry((1,), 9, 8), "topk"),
        (Geometry((1,), 0, 8), "topk"),
        (Geometry((1,), 1, 70000), "num_experts"),
    ],
)
def test_bad_geometry(geometry, message):
    with pytest.raises(InvalidArgument, match=message):
        geometry.validate()


def lp(n):
    return np.zeros(n, np.float32)


def test_turns_partition_the_tokens():
    check_turns([Turn(0, 5, 2, 0, lp(3)), Turn(5, 9, 9, 1)], 0, 9)
    with pytest.raises(InvalidArgument, match=r"turns\[1\].token_start is 6; expected 5"):
        check_turns([Turn(0, 5, 2), Turn(6, 9, 7)], 0, 9)
    with pytest.raises(InvalidArgument, match="turns end at token 5"):
        check_turns([Turn(0, 5, 2)], 0, 9)
    with pytest.raises(InvalidArgument, match="logprobs has 2 values for 3"):
        check_turns([Turn(0, 5, 2, 0, lp(2))], 0, 5)
    with pytest.raises(InvalidArgument, match="generated_start"):
        check_turns([Turn(0, 5, 6)], 0, 5)
    with pytest.raises(InvalidArgument, match="turns is empty"):
        check_turns([], 0, 5)


@pytest.mark.parametrize("num_experts", [2, 256, 257, 32768, 32769, 65536])
def test_replay_dtype_holds_every_stored_id_and_the_mask(num_experts):
    dtype = replay_dtype(num_experts)
    stored = np.array([0, num_experts - 1], dtype=route_dtype(num_experts))
    assert stored.astype(dtype).tolist() == [0, num_experts - 1]  # no id wraps around
    assert np.array(MASKED, dtype=dtype) == MASKED
    assert dtype.itemsize == (2 if num_experts <= 32768 else 4)
