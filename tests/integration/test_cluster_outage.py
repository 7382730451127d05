"""The whole Kafka cluster goes away while timers fall due, and every process rides it out.

One single-node Apache Kafka; a triggerer, a scheduler, a worker and a console as
processes; tasks deferred on timers falling due over 20 s; at 40 % the only broker is
SIGKILLed and started again on its data, or SIGSTOPped and SIGCONTed. Every task gets exactly
one resume RunTask as a ``read_committed`` reader sees it, with nobody restarting anything;
past ``--outage-limit`` each process exits non-zero with the limit in its message, and
processes started again once the cluster is back finish the work.

The scenario lives in tests/integration/_outage.py (``python -m bench.bench_cluster_outage``
reports its times and CPU). Apache Kafka only for the kill: the embedded Tansu keeps its
topics in memory, so a Tansu started again has none; it is frozen and thawed below instead.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Literal

import pytest
from deferline.topics import BrokerStartError

from tests.conftest import selected_backends, unavailable

from ._outage import BACK, LOST, OutageResult, run_outage

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PROCESSES = {"scheduler", "triggerer", "worker", "console"}


def _run(tmp_path: Path, broker: Literal["kafka", "tansu"], **scenario: Any) -> OutageResult:
    if broker not in selected_backends():
        pytest.skip(f"the {broker} backend is not selected")
    try:
        return asyncio.run(run_outage(tmp_path, broker=broker, **scenario))
    except BrokerStartError as exc:
        unavailable(broker, str(exc))
        raise


def _rode_it_out(result: OutageResult) -> None:
    summary = vars(result)
    assert result.resumed_tasks == result.n, summary  # every task resumed...
    assert result.duplicate_resumes == 0, summary  # ...exactly once
    assert result.exit_codes == dict.fromkeys(PROCESSES), summary  # nothing exited
    # Meanwhile the triggerer said it: unready, and its cluster unavailable.
    assert result.while_away["readyz"].startswith("503 unready: the Kafka cluster"), summary
    assert 'deferline_broker_available{process="triggerer"} 0.0' in result.while_away["metrics"]
    for name in PROCESSES:  # a line when lost, one when back, and back at the end
        lines = result.logs[name]
        assert any(LOST in m for m in lines), summary
        assert lines, summary
        assert BACK in lines[-1], summary


def test_every_process_rides_out_a_killed_broker_started_again_30s_later(
    tmp_path: Path,
) -> None:
    _rode_it_out(_run(tmp_path, "kafka", how="kill", n=5_000, outage=30.0))


def test_every_process_rides_out_a_broker_frozen_for_30s(tmp_path: Path) -> None:
    _rode_it_out(_run(tmp_path, "kafka", how="stop", n=5_000, outage=30.0))


def test_every_process_rides_out_a_frozen_tansu(tmp_path: Path) -> None:
    _rode_it_out(_run(tmp_path, "tansu", how="stop", n=5_000, outage=20.0))


def test_past_the_limit_each_process_exits_and_a_restart_finishes_the_work(
    tmp_path: Path,
) -> None:
    result = _run(
        tmp_path, "kafka", how="stop", n=5_000, outage=30.0, limit=5.0, restart_exited=True
    )
    summary = vars(result)
    assert result.exit_codes == dict.fromkeys(PROCESSES, 1), summary
    # Seen lost within a probe's 5 s and its interval, given up 5 s later, gone within the
    # exit grace of 15 s however stuck: none hangs on the frozen broker.
    assert result.exited_after_s < 5 + 2 + 5 + 15 + 3, summary
    for name in PROCESSES:
        assert "longer than the outage limit of 5 s" in result.exited_with[name], summary
    assert result.resumed_tasks == result.n, summary
    assert result.duplicate_resumes == 0, summary
