"""Airflow's triggerer metrics, on the bridge's Prometheus endpoint.

Named as Airflow's statsd metrics come out of the Prometheus statsd exporter's default
mapping (``airflow.triggers.running`` → ``airflow_triggers_running``; a counter gains
``_total``), with Airflow's ``hostname`` tag as a label; docs/airflow.md lists them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["BridgeMetrics"]


class BridgeMetrics:
    """The five triggerer metrics Airflow's UI and dashboards know, for one bridge."""

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
        self.set_running(0)

    def set_running(self, running: int) -> None:
        self._running.set(running)
        self._capacity_left.set(self.capacity - running)
