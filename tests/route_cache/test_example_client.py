"""examples/fetch_batch.py, the stubs-only reader a trainer of another framework would write,
against a real route cache: it must decode every encoding, dtype and appended turn exactly as
the project's own client does (two independent decoders of one wire contract)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from routereplay.dev.synthetic import synthetic_record
from routereplay.domain.codec import Encoding
from routereplay.domain.record import Turn, TurnAppend
from tests.route_cache.conftest import SMALL, WIDE

EXAMPLE = Path(__file__).parents[2] / "examples" / "fetch_batch.py"


def load_example():
    spec = importlib.util.spec_from_file_location("fetch_batch_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("redis_client", ["single"], indirect=True)
@pytest.mark.parametrize("encoding", list(Encoding))
def test_stubs_only_reader_decodes_what_the_client_reads(cache, rng, sid, encoding):
    client, server = cache
    client.encoding = encoding
    records = [
        synthetic_record(sid(), geometry, n, rng, skew=1.0, group_id="g")
        for geometry, n in ((SMALL, 3000), (WIDE, 700), (SMALL, 1))
    ]
    for record in records:
        client.write(record)
    # A second turn makes a record of two route blocks.
    two_turns = records[0]
    client.append(
        TurnAppend(
            two_turns.sample_id,
            SMALL,
            2999,
            np.arange(5, dtype=np.int32),
            synthetic_record("x", SMALL, 6, rng).routes[:5],
            [Turn(3000, 3005, 3001, 7)],
        )
    )
    ids = [r.sample_id for r in records] + [sid("absent")]
    example = load_example()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        fetched = example.fetch_batch(channel, ids)
    assert fetched[ids[-1]] is None
    for want in client.read_batch(ids[:-1]):
        got = fetched[want.sample_id]
        assert len(got.info.blocks) == (2 if want.sample_id == two_turns.sample_id else 1)
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        np.testing.assert_array_equal(got.routes(), want.routes)
        assert got.routes().dtype == want.routes.dtype


@pytest.mark.parametrize("redis_client", ["single"], indirect=True)
def test_reader_refuses_corrupted_bytes(cache, rng, sid):
    client, server = cache
    record = synthetic_record(sid(), SMALL, 100, rng)
    client.write(record)
    example = load_example()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        got = example.fetch_batch(channel, [record.sample_id])[record.sample_id]
    got.encoded[0][10] ^= 0xFF
    with pytest.raises(ValueError, match="checksum"):
        got.routes()


@pytest.mark.parametrize("redis_client", ["single"], indirect=True)
def test_example_command_line(cache, rng, sid):
    client, server = cache
    record = synthetic_record(sid(), SMALL, 50, rng)
    client.write(record)
    absent = sid("absent")
    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--target",
            f"127.0.0.1:{server.port}",
            record.sample_id,
            absent,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert f"{record.sample_id}: 50 tokens" in out
    assert f"routes (49, 5, 4) uint8, first row {record.routes[0].tolist()}" in out
    assert f"{absent}: not in the cache" in out
