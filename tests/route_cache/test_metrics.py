"""The route cache's Prometheus endpoint, scraped over real HTTP while real calls go through."""

from __future__ import annotations

import time
import uuid

import pytest

from route_cache.config import Config, parse_config
from route_cache.server import RouteCacheServer
from routereplay.dev.synthetic import synthetic_record
from routereplay.errors import AlreadyExists, NotFound
from routereplay.rpc.client import RouteCacheClient
from routereplay.rpc.metrics import MetricsConfig
from tests.route_cache.conftest import SMALL
from tests.support.metrics import scrape


@pytest.fixture
def served(store):
    metrics = MetricsConfig(True, "127.0.0.1", 0)  # a free port
    stream = f"rr:ready:{uuid.uuid4().hex[:8]}"  # this test's own ready feed
    config = Config(host="127.0.0.1", port=0, grace_s=1, ready_stream=stream, metrics=metrics)
    server = RouteCacheServer(config, store).start()
    client = RouteCacheClient(f"127.0.0.1:{server.port}", timeout_s=30)
    yield client, server, f"http://127.0.0.1:{server.metrics.port}/metrics"
    client.close()
    server.stop(0)


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_move_with_the_calls(served, rng, sid):
    client, _, url = served
    before = scrape(url)
    records = [synthetic_record(sid(), SMALL, 400, rng) for _ in range(3)]
    for record in records:
        client.write(record)
    client.write(records[0])  # a duplicate
    ids = [r.sample_id for r in records]
    whole = list(client.read_batch(ids))
    selected = list(client.read_batch(ids, layers=[1, 3]))
    with pytest.raises(NotFound):
        client.read(sid("absent"))
    after = scrape(url)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    stored = sum(r.routes.nbytes for r in records)  # RAW: stored bytes are the routes
    assert moved("route_cache_route_bytes_received_total") == stored + records[0].routes.nbytes
    # Whole reads send every stored byte; the selection 2 of the 5 layers' bytes.
    assert moved("route_cache_route_bytes_served_total") == stored + stored * 2 // 5
    assert sum(r.routes.nbytes for r in whole + selected) == stored + stored * 2 // 5
    assert moved("route_cache_records_committed_total", call="write", duplicate="false") == 3
    assert moved("route_cache_records_committed_total", call="write", duplicate="true") == 1
    assert moved("route_cache_rpc_calls_total", method="WriteRecord", code="OK") == 4
    assert moved("route_cache_rpc_calls_total", method="ReadBatch", code="OK") == 2
    assert moved("route_cache_rpc_calls_total", method="ReadRecord", code="NOT_FOUND") == 1
    assert moved("route_cache_rpc_latency_seconds_count", method="ReadBatch") == 2
    assert moved("route_cache_rpc_received_bytes_total", method="WriteRecord") > 4 * 2000
    assert moved("route_cache_rpc_sent_bytes_total", method="ReadBatch") > stored


def test_refusals_and_feed_backlog(served, rng, sid):
    client, _, url = served
    records = [synthetic_record(sid(), SMALL, 50, rng) for _ in range(3)]
    for record in records:
        client.write(record)
    other = synthetic_record(records[0].sample_id, SMALL, 60, rng)  # another record, same id
    with pytest.raises(AlreadyExists):
        client.write(other)
    client.read_ready("metrics-group", "c1", max_entries=1)  # creates the group, reads one
    time.sleep(0.05)
    samples = scrape(url)
    assert (
        value(samples, "route_cache_records_refused_total", call="write", code="ALREADY_EXISTS")
        == 1
    )
    assert value(samples, "route_cache_ready_pending", consumer_group="metrics-group") == 1
    assert value(samples, "route_cache_ready_backlog", consumer_group="metrics-group") == 2
    # its pending entry, announced before the sleep: older than that, younger than the test
    age = value(
        samples, "route_cache_ready_oldest_unconsumed_age_seconds", consumer_group="metrics-group"
    )
    assert 0.05 <= age < 60


def test_the_endpoint_is_off_by_default_and_configurable():
    assert parse_config([], env={}).metrics == MetricsConfig(False, "0.0.0.0", 9464)
    config = parse_config(["--metrics-port", "9999"], env={"ROUTE_CACHE_METRICS": "true"})
    assert config.metrics == MetricsConfig(True, "0.0.0.0", 9999)
