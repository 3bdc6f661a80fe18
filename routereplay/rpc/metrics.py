"""Prometheus metrics shared by the gRPC services: calls and errors by method and status, bytes
in and out, latency histograms (recorded by the interceptors of ``routereplay.rpc.grpc_server``),
plus whatever a service adds to the same registry. One registry per server object, so several
servers in one process (tests, the embedded route cache) keep separate counts.

The HTTP endpoint (``/metrics``, Prometheus text format) is off unless the service's
``--metrics`` flag turns it on: it has no TLS or token of its own, so it belongs on a port
that only the cluster's scraper reaches.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from routereplay.rpc.service_config import flag

# Calls of a route cache span 0.1 ms (a stat) to seconds (a 1024-record batch read).
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)


@dataclass(frozen=True)
class MetricsConfig:
    """Where a service serves ``/metrics``; see the fields' help."""

    metrics: bool = flag(
        False, "serve Prometheus metrics over HTTP at /metrics (no TLS or token: keep it internal)"
    )
    metrics_host: str = flag("0.0.0.0", "address of the metrics endpoint")
    metrics_port: int = flag(9464, "port of the metrics endpoint (0: any free port)")


class MetricsEndpoint:
    """A registry of its own and the HTTP endpoint that serves it at ``/metrics``: the one
    endpoint of the services and the trainer.

    Attributes:
        registry: Add metrics here (``registry=self.registry``).
        port: The endpoint's port once ``serve_at`` started it (0 before and after).
    """

    def __init__(self):
        self.registry = CollectorRegistry()
        self._http = None
        self.port = 0

    def serve_at(self, host: str, port: int):
        """Start the endpoint once (port 0: a free one, then in ``self.port``); returns self."""
        if self._http is None:
            self._http, _ = start_http_server(port, host, registry=self.registry)
            self.port = self._http.server_port
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
            self.port = 0


class ServiceMetrics(MetricsEndpoint):
    """The registry of one server and the per-call metrics every service has.

    Attributes:
        registry: add a service's own metrics here (``registry=metrics.registry``).
    """

    def __init__(self, namespace: str):
        super().__init__()
        self.namespace = namespace
        self.calls = Counter(
            "rpc_calls",
            "Finished calls by method and status code (errors: code != OK)",
            ["method", "code"],
            namespace=namespace,
            registry=self.registry,
        )
        self.latency = Histogram(
            "rpc_latency_seconds",
            "Call duration, first request message to last response",
            ["method"],
            namespace=namespace,
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.bytes_in = Counter(
            "rpc_received_bytes",
            "Serialized request bytes received, by method",
            ["method"],
            namespace=namespace,
            registry=self.registry,
        )
        self.bytes_out = Counter(
            "rpc_sent_bytes",
            "Serialized response bytes sent, by method",
            ["method"],
            namespace=namespace,
            registry=self.registry,
        )

        self._calls, self._latency, self._in, self._out = map(
            children, (self.calls, self.latency, self.bytes_in, self.bytes_out)
        )

    def observe(self, method: str, code: grpc.StatusCode, started: float) -> None:
        name = _short(method)
        self._calls(name, code.name).inc()
        self._latency(name).observe(time.perf_counter() - started)

    def received(self, method: str, size: int) -> None:
        self._in(_short(method)).inc(size)

    def sent(self, method: str, size: int) -> None:
        self._out(_short(method)).inc(size)

    def serve(self, config: MetricsConfig) -> ServiceMetrics:
        """Start the HTTP endpoint when ``config.metrics`` is on; ``self.port`` is its port."""
        if config.metrics:
            self.serve_at(config.metrics_host, config.metrics_port)
        return self


def children(metric):
    """``metric.labels``, each child remembered by its label values: prometheus_client looks
    one up under a lock on every call (3% of a small write's server time, sampled)."""
    return functools.cache(metric.labels)


@functools.cache
def _short(method: str) -> str:
    """``/routereplay.v1.RouteCache/ReadBatch`` -> ``ReadBatch``."""
    return method.rsplit("/", 1)[-1]
