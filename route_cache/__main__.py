"""``python -m route_cache`` / ``route-cache``: run the route cache server."""

from __future__ import annotations

import logging
import sys

from route_cache.config import parse_config
from route_cache.connection import connect
from route_cache.embedded import start_embedded_redis
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.allocator import keep_large_buffers


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_config(argv)
    keep_large_buffers()
    embedded = None
    url = config.redis_url
    if not url:
        embedded, url = start_embedded_redis()
    try:
        store = RouteStore(
            connect(
                url,
                config.redis_cluster,
                socket_timeout=30,
                socket_connect_timeout=5,
                **config.redis.connect_kwargs(),
            ),
            ttl_ms=int(config.ttl_s * 1000),
            wait_replicas=config.wait_replicas,
        )
        RouteCacheServer(config, store).start().wait()
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
