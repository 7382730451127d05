"""The worker's collector reads its queue, slots and counters at scrape time."""

from __future__ import annotations

from deferline.runners.worker.testing import SlotPool, WorkerCollector, WorkerMetrics
from prometheus_client import CollectorRegistry, generate_latest


def test_a_scrape_shows_the_counters_and_slots_as_they_are_then() -> None:
    slots, counters = SlotPool(4), WorkerMetrics()
    registry = CollectorRegistry()
    registry.register(WorkerCollector("fast", slots, counters))
    counters.started, counters.deferred = 3, 2
    slots.take()
    page = generate_latest(registry).decode()
    assert 'deferline_worker_tasks_started_total{queue="fast"} 3.0' in page
    assert 'deferline_worker_tasks_deferred_total{queue="fast"} 2.0' in page
    assert 'deferline_worker_slots{queue="fast"} 4.0' in page
    assert 'deferline_worker_slots_busy{queue="fast"} 1.0' in page
