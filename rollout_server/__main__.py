"""``python -m rollout_server`` / ``rollout-server``: run the rollout server."""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
from pathlib import Path

from rollout_server.config import Config, parse_config
from rollout_server.engine import VLLMEngine
from rollout_server.server import RolloutServer


def model_folder(config: Config) -> Path:
    """The checkpoint to serve: ``config.model``, or the embedded tiny model, built once."""
    if config.model:
        return Path(config.model)
    from routereplay.dev.tiny_model import build_tiny_model

    folder = Path(config.tiny_model_dir or Path(tempfile.gettempdir()) / "router-replay-tiny-moe")
    if not (folder / "config.json").is_file():
        logging.getLogger(__name__).info("building the embedded tiny model in %s", folder)
        build_tiny_model(folder)
    return folder


async def serve(config: Config) -> int:
    """Start the engine on this event loop (it is bound to it), serve, shut down. Returns the
    exit status: 1 when the engine died (so the container is restarted), else 0."""
    folder = model_folder(config)
    engine = VLLMEngine(
        folder,
        model_id=config.model_id or None,
        dtype=config.dtype or None,
        capture_routes=config.capture_routes,
        **config.engine_args(),
    )
    try:
        server = await RolloutServer(config, engine).start()
        await server.wait()
    finally:
        engine.shutdown()
    return 1 if server.engine_died else 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(serve(parse_config(argv)))


if __name__ == "__main__":
    sys.exit(main())
