"""The worker's Prometheus figures, read from the running worker at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._state import SlotPool, WorkerMetrics

__all__ = ["WorkerCollector"]


class WorkerCollector(Collector):
    """Worker figures read at scrape time."""

    def __init__(self, queue: str, slots: SlotPool, counters: WorkerMetrics) -> None:
        self._queue = queue
        self._slots = slots
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        counters, slots = self._counters, self._slots
        labels = ["queue"]
        value = [self._queue]
        for name, help_text, figure in (
            ("deferline_worker_tasks_started", "RunTasks started.", counters.started),
            ("deferline_worker_tasks_resumed", "RunTasks resumed.", counters.resumed),
            ("deferline_worker_tasks_succeeded", "Tasks that succeeded.", counters.succeeded),
            ("deferline_worker_tasks_failed", "Tasks that failed.", counters.failed),
            ("deferline_worker_tasks_retried", "Tasks set up for retry.", counters.retried),
            ("deferline_worker_tasks_skipped", "Tasks skipped.", counters.skipped),
            ("deferline_worker_tasks_deferred", "Deferrals published.", counters.deferred),
            ("deferline_worker_duplicates", "Duplicate RunTasks ignored.", counters.duplicates),
            (
                "deferline_worker_slot_seconds",
                "Worker-slot seconds spent running operators.",
                counters.slot_seconds,
            ),
        ):
            family = CounterMetricFamily(name, help_text, labels=labels)
            family.add_metric(value, figure)
            yield family
        for name, help_text, figure in (
            ("deferline_worker_slots", "Configured worker slots.", slots.size),
            ("deferline_worker_slots_busy", "Worker slots in use.", slots.busy),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=labels)
            gauge.add_metric(value, figure)
            yield gauge
