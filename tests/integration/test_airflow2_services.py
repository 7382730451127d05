"""Airflow 2.10 triggers that read what only Airflow's database knows, through the bridge's
Airflow services, in a real Airflow 2.10 deployment.

One deployment for the module (``airflow scheduler``, SequentialExecutor, SQLite); no
``airflow triggerer``. A bridge with ``--services-port`` and one deferline triggerer with
``DEFERLINE_AIRFLOW_SERVICES`` pointing at it, which gets none of Airflow's database settings
(tests/integration/_services_kit.py, ``triggerer_environment``). The connection and the
variable live only in Airflow's database. Each task ends as it ends with ``airflow
triggerer``:

* ``ExternalTaskSensor(deferrable=True)`` (``WorkflowTrigger``: ``sensor_helper._get_count``)
  waits for a task of another DAG's run of the same logical date, which ends after the sensor
  deferred: success.
* ``TriggerDagRunOperator(wait_for_completion=True, deferrable=True)`` (``DagStateTrigger``:
  its ``count_dags`` query) waits for the run it started: success, and so does that run.
* ``HttpSensor(deferrable=True)`` on the connection stored in the database, polling a local
  endpoint that answers 404 until the test makes it answer 200: success, after several polls.
* A user's trigger calling ``Variable.get`` synchronously inside ``async def run()``: the task
  resumes with the value Airflow's worker reads: success.
* A user's trigger reading a connection that exists nowhere: the task fails, its log with
  Airflow's own "isn't defined" error.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deferline.topics import Settings, free_port

from tests.airflow_line import airflow_line

from ._airflow_deployment import AirflowDeployment
from ._airflow_processes import Processes, reach, trigger_dag
from ._services_kit import (
    HTTP_CONN_ID,
    MISSING_CONN_ID,
    Endpoint,
    airflow_database_of,
    dag_run_reaches,
    requests_answered,
    services_of,
    stored_in_database,
    triggerer_environment,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.airflow,
    pytest.mark.timeout(480),
    pytest.mark.skipif(
        airflow_line() != 2,
        reason="Airflow 2.10's triggers; Airflow 3's are tests/integration/test_airflow_services",
    ),
]

DAGS = Path(__file__).with_name("airflow2_services_dags")
# The user triggers, shared with the Airflow 3 test (either line imports them).
TRIGGERS = Path(__file__).with_name("airflow_services_dags") / "services_triggers.py"
ALLOWED = "services_triggers,airflow.triggers,airflow.providers.http.triggers"
GATE_ENV = "SERVICES_TEST_GATE"  # services2_dags.GATE_ENV
RESUME_AFTER = 15  # services_triggers.RESUME_AFTER
FINAL = {"success", "failed", "skipped", "upstream_failed"}


@pytest.fixture(scope="module")
def airflow(
    tmp_path_factory: pytest.TempPathFactory, endpoint: Endpoint
) -> Iterator[AirflowDeployment]:
    """Airflow 2.10 with the test's connection and variable in its database, and nowhere else."""
    home = tmp_path_factory.mktemp("airflow")
    af = AirflowDeployment(
        home,
        extra_env={GATE_ENV: str(home / "gate"), "DEFERLINE_ALLOWED_TRIGGER_PREFIXES": ALLOWED},
        dags_from=DAGS,
        before_start=stored_in_database(endpoint),
    )
    shutil.copy(TRIGGERS, af.dags)
    try:
        af.start()
        af.wait_for(
            "SELECT count(*) FROM dag WHERE dag_id LIKE 'services2%' HAVING count(*) = 3",
            within=240,
        )
        yield af
    finally:
        af.close()


async def test_airflow2_triggers_read_what_only_airflows_database_knows(
    airflow: AirflowDeployment,
    endpoint: Endpoint,
    processes: Processes,
    settings: Settings,
    tmp_path: Path,
) -> None:
    af = airflow
    run_id = f"services2-{settings.topic_prefix.rstrip('.')}"
    logical_date = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()
    gated = {"external_sensor", "trigger_target", "http_sensor"}
    succeed = gated | {"reads_variable"}

    services_port = free_port()
    services = f"http://127.0.0.1:{services_port}"
    trigger_env = triggerer_environment(af, tmp_path / "triggerer_home", services, ALLOWED)
    trigger_home = Path(trigger_env["AIRFLOW_HOME"])
    metrics_port = free_port()
    bridge = processes.bridge(
        "bridge",
        "--services-port", str(services_port), "--services-host", "127.0.0.1",
        "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1",
    )  # fmt: skip
    processes.triggerer("triggerer", env=trigger_env)
    database_seen, *_ = await asyncio.gather(
        asyncio.to_thread(airflow_database_of, trigger_env),
        trigger_dag(af, "services2_upstream", run_id, logical_date=logical_date),
        trigger_dag(af, "services2", run_id, logical_date=logical_date),
    )
    # Airflow, imported with the triggerer's environment, knows no way to the deployment's
    # database.
    assert str(af.db_path) not in database_seen
    assert str(af.home) not in database_seen

    # The gated tasks stay deferred until the test opens the gate; the endpoint answers 404.
    await reach(af, "services2", run_id, gated, "deferred")
    deferred_at = time.monotonic()
    await asyncio.sleep(max(0.0, deferred_at + RESUME_AFTER - time.monotonic()))
    assert {t: s for t, s in af.states("services2", run_id).items() if t in gated} == (
        dict.fromkeys(gated, "deferred")
    )
    # Their triggers have been asking the bridge all along.
    assert requests_answered(metrics_port, "GetExternalTaskCount") >= 2
    assert requests_answered(metrics_port, "GetDRCount") >= 2
    endpoint.ready.set()
    await asyncio.to_thread(Path(af.env[GATE_ENV]).touch)

    await reach(af, "services2", run_id, succeed | {"missing_connection"}, FINAL)
    states = af.states("services2", run_id)
    assert states == {**dict.fromkeys(succeed, "success"), "missing_connection": "failed"}, states
    assert af.states("services2_upstream", run_id) == {"upstream_task": "success"}
    assert af.states("services2_target", run_id) == {"target_task": "success"}
    await dag_run_reaches(af, "services2_upstream", run_id, "success")
    await dag_run_reaches(af, "services2_target", run_id, "success")

    # HttpSensor: the worker's poke and the trigger's polls got 404, then the trigger a 200.
    assert endpoint.answers[-1] == 200
    assert endpoint.answers.index(200) >= 3, endpoint.answers
    assert requests_answered(metrics_port, "GetConnection") >= 2  # HttpSensor's, the missing
    assert requests_answered(metrics_port, "GetVariable") >= 1

    # A connection that exists nowhere: Airflow's own error, in the task's log.
    log = af.task_log("services2", "missing_connection", run_id=run_id)
    assert f"The conn_id `{MISSING_CONN_ID}` isn't defined" in log

    # The bridge's answers, asked directly: what 2.10's own reads return.
    def ask(request: dict[str, Any]) -> tuple[int, Any]:
        return post(f"{services}/v1/airflow/requests", {"request": request})

    status, frame = await asyncio.to_thread(ask, {"type": "GetConnection", "conn_id": HTTP_CONN_ID})
    assert (status, frame["error"]) == (200, None), frame
    assert frame["body"]["host"] == "127.0.0.1"
    assert frame["body"]["port"] == endpoint.port
    status, frame = await asyncio.to_thread(ask, {"type": "GetVariable", "key": "nowhere"})
    assert frame == {
        "body": None,
        "error": {
            "type": "ErrorResponse",
            "error": "VARIABLE_NOT_FOUND",
            "detail": {"key": "nowhere"},
        },
    }
    counted = {"type": "GetDRCount", "dag_id": "services2_target", "run_ids": [run_id]}
    status, frame = await asyncio.to_thread(ask, counted | {"states": ["success"]})
    assert frame["body"] == {"type": "DRCount", "count": 1}, frame
    status, frame = await asyncio.to_thread(ask, counted | {"states": ["failed"]})
    assert frame["body"] == {"type": "DRCount", "count": 0}, frame
    upstream = {
        "type": "GetExternalTaskCount",
        "dag_id": "services2_upstream",
        "task_ids": ["upstream_task"],
        "task_group_id": None,
        "logical_dates": [logical_date],
        "states": ["success"],
    }
    status, frame = await asyncio.to_thread(ask, upstream)
    assert frame["body"] == {"type": "ExternalTaskCount", "count": 1}, frame
    status, text = await asyncio.to_thread(ask, {"type": "GetXCom", "key": "k"})
    assert (status, "GetXCom" in text) == (400, True), text
    status, text = await asyncio.to_thread(ask, {"type": "GetDRCount"})
    assert (status, "malformed GetDRCount" in text) == (400, True), text

    assert services_of(bridge) == [services_port]
    assert not (trigger_home / "airflow.db").exists()
    assert processes.dead() == []


def post(url: str, body: Any) -> tuple[int, Any]:
    """POST ``body`` as JSON; the status and the JSON answer (the text of a refusal)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
