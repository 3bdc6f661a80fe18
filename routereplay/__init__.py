"""Router Replay's shared library, by concern.

- ``domain``: the record and its checks, the route codec, a model's MoE geometry, records
  files, route statistics, the Rollout's request and event types. No gRPC.
- ``rpc``: the conversions of each contract (``wire`` for the route cache, ``rollout_wire``),
  the sync and asyncio clients of both services, and what every server shares.
- ``dev``: what only development and tests need (tiny models, certificates, synthetic
  records, the process launcher).
- ``errors``: the errors of every service, each with the gRPC status it is answered with.
- ``routes_cli``: the ``routes`` tool.

Every service imports this package; no service imports another service's internals.
The generated gRPC stubs live in ``routereplay.v1`` (built by ``make proto``).
"""
