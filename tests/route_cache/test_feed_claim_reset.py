"""An acknowledgement whose Redis connection is reset must still count for the consumer that
alone holds its entry.

Found by the fault run (``proxy_drop`` on the shard holding a sample's settle claim): the
claim was queued as HSETNX then HGET on a cluster pipeline; the connection was reset, the
cluster client retried the failed commands one by one, and the HGET ran before the HSETNX.
It answered nil, so the sole consumer of the sample was told another one had settled it,
acknowledged it without training, and nobody trained the sample (``never_trained: 1``). The
claim is one script now.

A one-node Redis Cluster behind a fault proxy (the node announces the proxy's port, so every
connection goes through it); four consumers acknowledge their own entries, one per call, while
the proxy resets every connection and refuses new ones for a moment, again and again.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis

from route_cache.connection import connect
from route_cache.feed import ReadyFeed
from routereplay.dev.fault_proxy import FaultProxy
from routereplay.dev.redis_nodes import RedisProcess, start_cluster
from routereplay.errors import RouteReplayError

CONSUMERS = 4
ENTRIES = 8000  # more than the consumers acknowledge in the time given
RUN_S = 10.0
# Each reset refuses new connections longer than one command's retries last (ten, at most
# 0.1 s apart), and not much longer: a pipeline's first failed command then runs out of
# retries while the refusal lasts and the next ones are retried after it.
REFUSE_S = 0.7


@pytest.fixture
def proxied_cluster():
    proxies = []

    def node() -> RedisProcess:
        made = RedisProcess(cluster=True)
        proxy = FaultProxy(made.port).start()
        made.extra += ["--cluster-announce-port", str(proxy.port)]
        made.extra += ["--cluster-announce-bus-port", str(made.bus_port)]
        proxies.append(proxy)
        return made

    (made,) = start_cluster(1, make_node=node)
    yield made, proxies[0]
    proxies[0].close()
    made.stop()


def test_a_reset_connection_never_tells_the_sole_consumer_its_entry_was_taken(proxied_cluster):
    made, proxy = proxied_cluster
    client = connect(f"redis://127.0.0.1:{proxy.port}/0", cluster=True)
    feed = ReadyFeed(client, f"rr:ready:{uuid.uuid4().hex[:8]}", settled_ttl_ms=60_000)
    direct = redis.Redis(port=made.port)
    pipe = direct.pipeline(transaction=False)
    for i in range(ENTRIES):
        pipe.xadd(feed.stream, {"sample_id": f"s{i}", "group_id": "", "num_tokens": 1})
    pipe.execute()
    direct.xgroup_create(feed.stream, "g", id="0")
    held = {}  # consumer -> [(entry id, sample id)], delivered to it alone
    for name in [f"c{i}" for i in range(CONSUMERS)]:
        count = ENTRIES // CONSUMERS
        ((_, entries),) = direct.xreadgroup("g", name, {feed.stream: ">"}, count=count)
        held[name] = [(e.decode(), f[b"sample_id"].decode()) for e, f in entries]

    answers = {name: [] for name in held}  # each acknowledgement's final count
    stop = threading.Event()

    def consumer(name: str) -> None:
        for entry_id, sample_id in held[name]:
            while not stop.is_set():  # retried until answered, as ReadyConsumer.settle is
                try:
                    answers[name].append(feed.ack("g", [entry_id], name, [sample_id]))
                    break
                except (RouteReplayError, redis.RedisError):
                    time.sleep(0.01)
            if stop.is_set():
                return

    threads = [threading.Thread(target=consumer, args=(n,)) for n in held]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline:
        time.sleep(0.4)
        proxy.drop(REFUSE_S)
        time.sleep(REFUSE_S)
    stop.set()
    for thread in threads:
        thread.join()
    client.close()
    counts = [n for name in held for n in answers[name]]
    assert proxy.dropped >= 8 and len(counts) >= 200, (proxy.dropped, len(counts))
    assert counts.count(0) == 0, f"{counts.count(0)} of {len(counts)} told taken"
