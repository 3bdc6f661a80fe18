"""Prometheus metrics of a training run, served over HTTP by the lead rank (``report.metrics``).

Updated from each step's report (``RLStep.run``; every figure is already summed or maxed over
the ranks there): how long the step took, how long the loop waited for its batch's records,
routing agreement per MoE layer, and the route bytes read from the route cache against the
stored bytes of the batch's records. Off by default, like the services' endpoints
(``routereplay.rpc.metrics``): ``/metrics`` has no TLS or token, so keep its port internal.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from routereplay.rpc.metrics import LATENCY_BUCKETS, MetricsEndpoint
from trainer.report.step_report import StepReport

NAMESPACE = "trainer"
# A tiny model's step takes a second on a CPU; a large one's minutes.
STEP_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class TrainerMetrics(MetricsEndpoint):
    """One run's metrics in a registry of its own, served like the services' (``serve_at``)."""

    def __init__(self):
        super().__init__()
        kw = dict(namespace=NAMESPACE, registry=self.registry)
        self.steps = Counter("steps", "RL steps done", **kw)
        self.step_seconds = Histogram(
            "step_seconds",
            "Wall time of an RL step, fetch wait included",
            buckets=STEP_BUCKETS,
            **kw,
        )
        self.fetch_wait = Histogram(
            "fetch_wait_seconds",
            "Time the loop waited for a batch's records (0: prefetched)",
            buckets=LATENCY_BUCKETS,
            **kw,
        )
        self.agreement = Gauge(
            "routing_agreement",
            "Last step's fraction of rows whose natural top-k set equals "
            "the rollout's, per MoE layer",
            ["layer"],
            **kw,
        )
        self.replay_followed = Gauge(
            "replay_followed",
            "Last step's fraction of replayed rows routed exactly as the "
            "rollout (R3), per MoE layer",
            ["layer"],
            **kw,
        )
        self.route_bytes_read = Counter(
            "route_bytes_read", "Route bytes the ranks read from the route cache", **kw
        )
        self.route_bytes_batch = Counter(
            "route_bytes_batch", "Route bytes of the whole records of the batches trained", **kw
        )
        self.last_step = Gauge("last_step", "Number of the last step done", **kw)
        self.loss = Gauge("loss", "Last step's PPO loss", **kw)
        self.reward = Gauge("reward_mean", "Last step's mean reward", **kw)

    def observe(self, report: StepReport, step_s: float) -> None:
        """Count one step from its report and its wall time."""
        self.steps.inc()
        self.step_seconds.observe(step_s)
        self.fetch_wait.observe(report.time_s.fetch_wait)
        agreement = report.agreement
        for layer, value in zip(agreement.layers, agreement.exact, strict=False):
            self.agreement.labels(str(layer)).set(value)
        followed = report.replay_followed
        if followed is not None:
            for layer, value in zip(followed.layers, followed.exact, strict=True):
                self.replay_followed.labels(str(layer)).set(value)
        self.route_bytes_read.inc(report.route_bytes.read)
        self.route_bytes_batch.inc(report.route_bytes.batch)
        self.last_step.set(report.step)
        self.loss.set(report.loss)
        self.reward.set(report.reward_mean)
