"""Policy sync: the rollout servers load the trainer's exported weights (``UpdateWeights``), so
their next samples come from the new policy (``push.targets``)."""

from __future__ import annotations

from pathlib import Path


def push_weights(
    targets: str, folder: str | Path, security=None, timeout_s: float = 600.0
) -> list[int]:
    """Have each rollout server in ``targets`` (comma-separated ``host:port``) load ``folder``
    through ``UpdateWeights``, one after the other; returns their new policy versions.
    ``security``: a ``routereplay.rpc.security.ClientSecurity`` (default: plaintext).

    Each server drains its running turns first, so every turn's record names the weights that
    generated it. The folder must be readable by the servers (shared storage).

    Raises:
        RouteReplayError: a server refused or could not be reached (the gRPC status's class).
    """
    from routereplay.rpc.rollout_client import RolloutClient
    from routereplay.rpc.security import PLAINTEXT

    path = str(Path(folder).resolve())
    versions = []
    for target in filter(None, (t.strip() for t in targets.split(","))):
        with RolloutClient(target, timeout_s, security or PLAINTEXT) as client:
            reply = client.update_weights(path, wait_for_ready=True)
        versions.append(int(reply.policy_version))
    return versions
