"""The RPC layer: each contract's conversions to and from ``routereplay.v1`` (``wire``,
``rollout_wire``), the clients, and what every server shares (interceptors, limits, security,
flags, metrics, health)."""
