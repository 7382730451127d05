"""DAGs of the Airflow 2.10 services test: tasks whose triggers read what only Airflow's
database knows (task-instance and DAG-run counts, connections, variables)."""

# mypy: ignore-errors
from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from airflow import DAG
from airflow.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.providers.http.sensors.http import HttpSensor
from airflow.sensors.external_task import ExternalTaskSensor
from airflow.sensors.python import PythonSensor
from services_triggers import ReadsConnection, ReadsVariable

ARGS = {"retries": 0}
START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
HTTP_CONN_ID = "services_http"  # stored in Airflow's database by the test
VARIABLE_KEY = "services_greeting"  # stored in Airflow's database by the test
MISSING_CONN_ID = "services_no_such_conn"  # stored nowhere

# The file whose creation lets the gated tasks end (the deployment's environment names it).
GATE_ENV = "SERVICES_TEST_GATE"


def waits_for_gate(task_id: str) -> PythonSensor:
    """Succeeds once the test creates the gate file. It pokes in reschedule mode: 2.10's
    SequentialExecutor runs one task at a time, and a task waiting in place would hold it."""
    return PythonSensor(
        task_id=task_id,
        python_callable=lambda: Path(os.environ[GATE_ENV]).exists(),
        mode="reschedule",
        poke_interval=1,
        timeout=300,
    )


# The task the sensor waits for, in a run of the same logical date; it ends when the test
# opens the gate, after the sensor has deferred.
with DAG(dag_id="services2_upstream", schedule=None, start_date=START, default_args=ARGS):
    waits_for_gate("upstream_task")

# The DAG trigger_target starts and waits for; it too ends once the gate is opened.
with DAG(dag_id="services2_target", schedule=None, start_date=START, default_args=ARGS):
    waits_for_gate("target_task")

with DAG(dag_id="services2", schedule=None, start_date=START, default_args=ARGS):
    # WorkflowTrigger: sensor_helper._get_count, each poke.
    ExternalTaskSensor(
        task_id="external_sensor",
        external_dag_id="services2_upstream",
        external_task_id="upstream_task",
        deferrable=True,
        poke_interval=1,
        timeout=300,
    )
    # DagStateTrigger: count_dags, each poke.
    TriggerDagRunOperator(
        task_id="trigger_target",
        trigger_dag_id="services2_target",
        trigger_run_id="{{ run_id }}",
        wait_for_completion=True,
        deferrable=True,
        poke_interval=1,
    )
    # HttpSensorTrigger: the connection (sync, in sync_to_async's thread), then polls.
    HttpSensor(
        task_id="http_sensor",
        http_conn_id=HTTP_CONN_ID,
        endpoint="ready",
        deferrable=True,
        poke_interval=1,
        timeout=300,
    )
    # A user's trigger: Variable.get, a sync call inside run().
    ReadsVariable(task_id="reads_variable", key=VARIABLE_KEY)
    # A user's trigger: BaseHook.get_connection of a connection Airflow does not have.
    ReadsConnection(task_id="missing_connection", conn_id=MISSING_CONN_ID)
