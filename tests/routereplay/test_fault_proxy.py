"""The fault proxy in front of a real redis-server: it relays, delays and drops."""

from __future__ import annotations

import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from routereplay.dev.fault_proxy import FaultProxy


def test_relays_delays_and_drops(redis_node):
    proxy = FaultProxy(redis_node.port).start()
    try:
        client = redis.Redis(port=proxy.port, socket_timeout=5)
        client.set("proxied", b"x" * 1_000_000)
        assert client.get("proxied") == b"x" * 1_000_000

        proxy.delay_s = 0.2
        start = time.monotonic()
        client.ping()  # one chunk each way
        assert time.monotonic() - start >= 0.4
        proxy.delay_s = 0.0

        proxy.drop(1.0)
        assert proxy.dropped == 1
        fresh = redis.Redis(port=proxy.port, socket_timeout=2, retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.ConnectionError):
            fresh.ping()  # refused while the link is down
        time.sleep(1.1)
        assert fresh.ping()  # and back afterwards
    finally:
        proxy.close()
