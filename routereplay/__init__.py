"""Router Replay's shared library: the record, its codec, the wire conversion and the clients.

Every service imports this package; no service imports another service's internals.
The generated gRPC stubs live in ``routereplay.v1`` (built by ``make proto``).
"""
