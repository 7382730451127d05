"""Three Apache Kafka nodes; the one leading most partitions is SIGKILLed while 20,000
timers fall due, then restarted. Nothing is lost, nothing resumes twice, nothing restarts.

The scenario (and its lag figures, reported by ``python -m bench.bench_broker_failover``)
lives in tests/integration/_failover.py; this test asserts its counts only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from deferline.topics import KRaftCluster

from ._failover import run_failover

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

N = 5_000


def test_a_broker_dies_while_timers_fall_due(kafka_cluster: KRaftCluster, tmp_path: Path) -> None:
    result = asyncio.run(run_failover(kafka_cluster, n=N, window=20.0, state_dir=tmp_path))
    summary = result.summary()
    assert result.leaders_before.get(result.killed_node, 0) > 0, summary
    assert result.idempotent, "Apache Kafka grants idempotent producers"
    assert result.fired == N, summary  # every trigger fired
    assert result.resumed_tasks == N, summary  # every task resumed...
    assert result.duplicate_resumes == 0, summary  # ...exactly once
    assert result.still_deferred == 0, summary
    # The same triggerer and scheduler, never restarted, serve timers due after the restart.
    assert result.late_batch_fired == result.late_batch, summary
    assert all(kafka_cluster.running(node) for node in kafka_cluster.node_ids())
