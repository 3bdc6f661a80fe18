"""The trainer's Prometheus endpoint (``report.metrics``), scraped over real HTTP during a real
run: one rank, megatron-core on gloo, records from a real route cache over a redis-server.
The counters are held against the step reports and the route cache's own byte counter."""

from __future__ import annotations

import pytest

from routereplay.dev.launch import free_port
from tests.support.metrics import scrape

pytest.importorskip("megatron.core")


@pytest.fixture
def cache(redis_node, rollout):
    from route_cache.config import Config
    from route_cache.connection import connect
    from route_cache.server import RouteCacheServer
    from route_cache.store import RouteStore
    from trainer.data.source import CacheSource

    client = connect(redis_node.url, cluster=False)
    server = RouteCacheServer(Config(host="127.0.0.1", port=0, grace_s=1), RouteStore(client))
    server.start()
    source = CacheSource(f"127.0.0.1:{server.port}")
    for record in rollout:
        source.client.write(record)
    yield server, source
    source.close()
    server.stop(0)
    client.close()


def _value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_the_lead_serves_step_fetch_agreement_and_route_bytes(
    tiny_model_dir, rollout, cache, pg_collection
):
    from trainer.config import load_config
    from trainer.data.source import BatchPlan
    from trainer.train import train

    server, source = cache
    port = free_port()
    config = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "route_cache.target=unused",
            "router_replay.mode=R3",
            "train.batch_size=4",
            "train.micro_batch_size=4",
            "train.ppo_epochs=1",
            "report.compare=false",
            "data.prefetch=false",
            "report.metrics=true",
            "report.metrics_host=127.0.0.1",
            f"report.metrics_port={port}",
        ],
    )
    ids = [r.sample_id for r in rollout]
    url = f"http://127.0.0.1:{port}/metrics"
    scrapes = []

    def plans():
        # Without prefetch the loop asks for the next batch after the step is counted.
        for step in range(2):
            yield BatchPlan(ids[step * 4 : (step + 1) * 4])
            scrapes.append(scrape(url))

    served = server.metrics.registry.get_sample_value
    before = served("route_cache_route_bytes_served_total") or 0.0
    reports = train(config, plans(), pg_collection=pg_collection, source=source)
    served_now = served("route_cache_route_bytes_served_total") - before

    assert len(scrapes) == 2
    for n, (samples, report) in enumerate(zip(scrapes, reports, strict=True), start=1):
        assert _value(samples, "trainer_steps_total") == n
        assert _value(samples, "trainer_step_seconds_count") == n
        assert _value(samples, "trainer_fetch_wait_seconds_count") == n
        assert _value(samples, "trainer_last_step") == report.step
        assert _value(samples, "trainer_loss") == pytest.approx(report.loss)
        layers = report.agreement.layers
        assert [_value(samples, "trainer_routing_agreement", layer=str(x)) for x in layers] == (
            pytest.approx(report.agreement.exact)
        )
        assert [_value(samples, "trainer_replay_followed", layer=str(x)) for x in layers] == [
            1.0 for _ in layers
        ]
    total = scrapes[-1]
    step_s = _value(total, "trainer_step_seconds_sum")
    assert step_s >= sum(r.time_s.update + r.time_s.old_logprob for r in reports)
    # What the trainer read is what the route cache served: each batch's records, once.
    stored = sum(r.routes.nbytes for r in rollout[:8])
    assert _value(total, "trainer_route_bytes_read_total") == served_now == stored
    assert _value(total, "trainer_route_bytes_batch_total") == stored
    with pytest.raises(OSError):  # the endpoint ends with the run
        scrape(url, timeout_s=2)
