"""The Airflow bridge and a deferline triggerer ride out a lost Kafka cluster while Airflow's
triggers fall due.

A real Airflow 3 deployment (scheduler, DAG processor, API server, LocalExecutor, SQLite),
no ``airflow triggerer``; ``deferline airflow bridge`` and one ``deferline triggerer`` on a
single-node Apache Kafka of the test's own. Eight date-time sensors defer, due 4 s apart;
after the first has fired the only broker is SIGKILLed and started again on its data 30 s
later, so the others fall due while no broker answers. Nobody restarts anything.

Every task succeeds on its first try, none run twice (no task-instance history), and both
processes said when they lost the cluster and when they had it back. Meanwhile the bridge
keeps its ``TriggererJob`` heartbeat: its rows stay its own (docs/airflow.md).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import uuid
from functools import partial
from pathlib import Path

import pytest
from deferline.topics import KRaftBroker, Settings

from tests._until import until
from tests.airflow_line import STANDARD_TRIGGERS, airflow_line

from ._airflow_deployment import airflow_deployment
from ._airflow_processes import Processes
from ._outage import BACK, LOST

pytestmark = [
    pytest.mark.integration,
    pytest.mark.airflow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        airflow_line() < 3,
        reason="the bridge rides a lost cluster out in code shared by both Airflow lines "
        "(runners/_outage.py); Airflow 3's deployment runs it",
    ),
]

DAGS = Path(__file__).parent / "airflow_outage_dags"
TASKS = 8
STEP = 4.0
RUN = "outage-run"


async def test_the_bridge_rides_out_a_lost_cluster_while_airflow_triggers_fall_due(
    tmp_path: Path,
) -> None:
    broker = KRaftBroker(data_dir=tmp_path / "kafka")
    await broker.start()
    settings = Settings(
        bootstrap_servers=broker.bootstrap,
        topic_prefix=f"b{uuid.uuid4().hex[:8]}.",
        partitions=3,
        enable_idempotence=True,
    )
    home = tmp_path / "airflow"
    home.mkdir()
    env = {"DEFERLINE_ALLOWED_TRIGGER_PREFIXES": STANDARD_TRIGGERS}
    try:
        with airflow_deployment(home, extra_env=env, dags_from=DAGS) as af:
            started = Processes(settings, af, tmp_path)
            try:
                bridge = started.bridge("bridge")
                triggerer = started.triggerer("triggerer")
                await until(
                    partial(
                        asyncio.to_thread,
                        lambda: bool(af.query("SELECT dag_id FROM dag WHERE dag_id = 'outage'")),
                    ),
                    within=180,
                    interval=0.5,
                    what="Airflow knows the DAG",
                )
                first = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)
                due = [first + dt.timedelta(seconds=STEP * i) for i in range(TASKS)]
                conf = json.dumps({"at": [d.isoformat() for d in due]})
                await asyncio.to_thread(
                    af.run, "dags", "trigger", "outage", "--run-id", RUN, "--conf", conf
                )

                def claimed() -> bool:
                    rows = af.query(
                        "SELECT t.triggerer_id FROM trigger t JOIN task_instance ti "
                        "ON ti.trigger_id = t.id WHERE ti.run_id = ? AND ti.state = 'deferred'",
                        RUN,
                    )
                    return len(rows) == TASKS and all(r[0] is not None for r in rows)

                await until(
                    partial(asyncio.to_thread, claimed),
                    within=180,
                    interval=0.5,
                    what="every task deferred and claimed by the bridge",
                )
                wait = (first - dt.datetime.now(dt.UTC)).total_seconds() + 1.0
                await asyncio.sleep(max(0.0, wait))  # the first has fired
                pid = broker.pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                await broker.stop()
                await asyncio.sleep(30.0)  # the other seven fall due meanwhile
                await broker.start()

                def finished() -> bool:
                    rows = af.query("SELECT state FROM dag_run WHERE run_id = ?", RUN)
                    return bool(rows) and rows[0][0] in ("success", "failed")

                await until(
                    partial(asyncio.to_thread, finished),
                    within=240,
                    interval=0.5,
                    what="the run finished",
                )
                states = af.states("outage", RUN)
                assert states == {f"wait_{i}": "success" for i in range(TASKS)}
                tries = af.query("SELECT try_number FROM task_instance WHERE run_id = ?", RUN)
                assert {t[0] for t in tries} == {1}
                history = af.query(
                    "SELECT count(*) FROM task_instance_history WHERE run_id = ?", RUN
                )
                assert history[0][0] == 0  # no task instance ran again or was retried
                for process in (bridge, triggerer):
                    assert process.alive, process.log_path
                    messages = [line.get("message", "") for line in process.lines()]
                    assert any(LOST in m for m in messages), process.log_path
                    assert any(BACK in m for m in messages), process.log_path
            finally:
                started.close()
    finally:
        await broker.stop()
