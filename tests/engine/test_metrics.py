"""Metrics: the fire-lag histogram and the snapshot the runner exposes."""

from __future__ import annotations

import pytest
from deferline.engine import LagHistogram, SupervisorMetrics, TriggerSupervisor

from tests._until import until

from ._support import GateTrigger, Sink


def test_histogram_buckets_sum_and_quantiles() -> None:
    hist = LagHistogram([0.01, 0.1, 1.0])
    for value in (0.005, 0.05, 0.05, 0.5, 5.0, -0.001):
        hist.observe(value)
    assert hist.counts == [2, 2, 1, 1]
    assert hist.count == 6
    assert hist.max == 5.0
    assert hist.sum == pytest.approx(5.604)
    assert hist.cumulative() == [(0.01, 2), (0.1, 4), (1.0, 5), (float("inf"), 6)]
    assert 0.01 <= hist.quantile(0.5) <= 0.1
    assert hist.quantile(1.0) == 5.0
    assert LagHistogram().quantile(0.99) == 0.0
    with pytest.raises(ValueError, match="within"):
        hist.quantile(1.5)
    with pytest.raises(ValueError, match="increasing"):
        LagHistogram([1.0, 0.5])


def test_detached_metrics_read_zero_gauges() -> None:
    metrics = SupervisorMetrics()
    assert metrics.running == 0
    assert metrics.capacity_left == 0


async def test_snapshot_reports_gauges_and_counters() -> None:
    sink = Sink()
    async with TriggerSupervisor(capacity=3, on_event=sink, block_threshold=None) as sup:
        gates = [GateTrigger() for _ in range(4)]
        for i, gate in enumerate(gates):
            sup.add(f"g{i}", gate)
        snap = sup.metrics.snapshot()
        assert (snap["running"], snap["pending"], snap["capacity"], snap["capacity_left"]) == (
            3,
            1,
            3,
            0,
        )
        for gate in gates:
            gate.gate.set()
        await until(lambda: len(sup) == 0)
        snap = sup.metrics.snapshot()
        assert snap["fired"] == 4
        assert snap["running"] == 0
        assert snap["capacity_left"] == 3
