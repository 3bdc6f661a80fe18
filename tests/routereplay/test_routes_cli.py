"""The routes tool against a real route cache (real Redis, real gRPC)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from route_cache.config import Config
from route_cache.connection import connect
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.dev.synthetic import synthetic_record
from routereplay.domain.record import Geometry
from routereplay.domain.record_file import load_records, save_records
from routereplay.routes_cli import main
from routereplay.rpc.client import RouteCacheClient

G = Geometry((1, 2, 3), 2, 8, "tiny")


@pytest.fixture
def cache(redis_node):
    store = RouteStore(connect(redis_node.url, cluster=False), ttl_ms=60_000)
    server = RouteCacheServer(Config(host="127.0.0.1", port=0), store).start()
    yield f"cache:127.0.0.1:{server.port}"
    server.stop(0)


def test_export_import_inspect_compare_plot(cache, tmp_path, capsys):
    rng = np.random.default_rng(3)
    records = [synthetic_record(f"cli-{i}-{rng.integers(1e9)}", G, 60, rng) for i in range(3)]
    ids = [r.sample_id for r in records]
    source = tmp_path / "rollout.npz"
    save_records(source, records)

    assert main(["import", str(source), cache]) == 0
    assert "stored 3 records (0 were already there)" in capsys.readouterr().out
    assert main(["import", str(source), cache]) == 0
    assert "(3 were already there)" in capsys.readouterr().out

    exported = tmp_path / "exported.pt"
    assert main(["export", cache, str(exported), *ids]) == 0
    for a, b in zip(load_records(exported), records, strict=True):
        np.testing.assert_array_equal(a.routes, b.routes)

    assert main(["inspect", cache, ids[0]]) == 0
    out = capsys.readouterr().out
    assert f"{ids[0]} group=- model=tiny: 60 tokens, 59 rows" in out
    assert out.count("  layer ") == 3

    # A trainer's routes: reversed top-k order everywhere (still the same sets), and on
    # layer 2 one expert swapped for an unused one on every odd row.
    trained = []
    for r in records:
        routes = r.routes[..., ::-1].copy()
        for row in range(1, r.num_rows, 2):
            unused = next(e for e in range(8) if e not in routes[row, 1])
            routes[row, 1, 0] = unused
        trained.append(replace(r, routes=routes))
    trainer_file = tmp_path / "trainer.npz"
    save_records(trainer_file, trained)
    assert main(["compare", cache, str(trainer_file), *ids]) == 0
    out = capsys.readouterr().out
    lines = {int(line.split()[1].rstrip(":")): line for line in out.splitlines()[1:]}
    assert "same top-k 100.00%" in lines[1] and "same top-k 100.00%" in lines[3]
    even_rows = (59 + 1) // 2  # rows 0, 2, ..., 58 of each record are untouched
    assert f"same top-k {even_rows / 59:7.2%}" in lines[2], lines[2]

    figure = tmp_path / "routes.png"
    assert main(["plot", cache, *ids, "--out", str(figure), "--against", str(trainer_file)]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_sample_is_a_clear_error(cache, capsys):
    assert main(["inspect", cache, "no-such-sample"]) == 1
    assert "NotFound: no record for sample_id 'no-such-sample'" in capsys.readouterr().err


def test_client_is_closed(cache):
    with RouteCacheClient(cache.removeprefix("cache:")) as client:
        assert client.target.endswith(cache.rsplit(":", 1)[1])
