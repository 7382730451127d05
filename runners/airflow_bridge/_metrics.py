"""Airflow's triggerer metrics, on the bridge's Prometheus endpoint.

Named as Airflow's statsd metrics come out of the Prometheus statsd exporter's default
mapping (``airflow.triggers.running`` → ``airflow_triggers_running``; a counter gains
``_total``), with Airflow's ``hostname`` tag as a label; docs/airflow.md lists them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["BridgeMetrics"]


class BridgeMetrics:
    """The five triggerer metrics Airflow's UI and dashboards know, for one bridge, and its
    services' requests."""

    def __init__(self, *, hostname: str, capacity: int) -> None:
        self.registry = CollectorRegistry()
        self.capacity = capacity
        labels = ["hostname"]
        self._running = Gauge(
            "airflow_triggers_running",
            "Trigger rows this bridge has claimed and handed to deferline (triggers.running).",
            labels,
            registry=self.registry,
        ).labels(hostname=hostname)
        self._capacity_left = Gauge(
            "airflow_triggerer_capacity_left",
            "Capacity minus the rows claimed (triggerer.capacity_left).",
            labels,
            registry=self.registry,
        ).labels(hostname=hostname)
        self.succeeded = Counter(
            "airflow_triggers_succeeded",
            "Trigger events written back to Airflow (triggers.succeeded).",
            registry=self.registry,
        )
        self.failed = Counter(
            "airflow_triggers_failed",
            "Trigger failures written back to Airflow, bad rows included (triggers.failed).",
            registry=self.registry,
        )
        self.blocked_main_thread = Counter(
            "airflow_triggers_blocked_main_thread",
            "Times the bridge's event loop was blocked for 0.2 s or more "
            "(triggers.blocked_main_thread).",
            registry=self.registry,
        )
        self._requests = Counter(
            "deferline_airflow_requests",
            "Runtime requests of Airflow triggers answered by the bridge's services, by kind "
            "and outcome (answered; error: Airflow's answer is an error; refused: not opened, "
            "malformed or not a trigger's request).",
            ["kind", "outcome"],
            registry=self.registry,
        )
        self._lookups = Counter(
            "deferline_airflow_lookups",
            "Runtime requests run against Airflow's database: fewer than those answered when "
            "identical reads arrived at once and shared one lookup.",
            ["kind"],
            registry=self.registry,
        )
        self._request_seconds = Histogram(
            "deferline_airflow_request_seconds",
            "Time the bridge's services took to answer a runtime request.",
            ["kind"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.set_running(0)

    def count_lookup(self, kind: str) -> None:
        self._lookups.labels(kind=kind).inc()

    def count_request(self, kind: str, outcome: str, seconds: float) -> None:
        self._requests.labels(kind=kind, outcome=outcome).inc()
        self._request_seconds.labels(kind=kind).observe(seconds)

    def set_running(self, running: int) -> None:
        self._running.set(running)
        self._capacity_left.set(self.capacity - running)
