"""DAGs of the Airflow services test: tasks whose triggers ask Airflow's runtime for what only
Airflow's database knows (task-instance counts, DAG-run state, connections, variables,
human-in-the-loop requests)."""

# mypy: ignore-errors
from __future__ import annotations

import datetime as dt

from airflow.providers.http.sensors.http import HttpSensor
from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.providers.standard.sensors.external_task import ExternalTaskSensor
from airflow.sdk import DAG
from services_ops import ApprovalOnTrigger, HITLOnTrigger, PollsVariableForever, WaitsForGate
from services_triggers import RESUME_AFTER, ReadsConnection, ReadsVariable

ARGS = {"retries": 0}
START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
HTTP_CONN_ID = "services_http"  # stored in Airflow's database by the test
VARIABLE_KEY = "services_greeting"  # stored in Airflow's database by the test
MISSING_CONN_ID = "services_no_such_conn"  # stored nowhere

# The task the sensor waits for, in a run of the same logical date; it ends when the test
# opens the gate, after the sensor has deferred.
with DAG(dag_id="services_upstream", schedule=None, start_date=START, default_args=ARGS):
    WaitsForGate(task_id="upstream_task")

# The DAG trigger_target starts and waits for; it too ends once the gate is opened.
with DAG(dag_id="services_target", schedule=None, start_date=START, default_args=ARGS):
    WaitsForGate(task_id="target_task")

with DAG(dag_id="services", schedule=None, start_date=START, default_args=ARGS):
    # WorkflowTrigger: GetTICount, each poke.
    ExternalTaskSensor(
        task_id="external_sensor",
        external_dag_id="services_upstream",
        external_task_id="upstream_task",
        deferrable=True,
        poke_interval=1,
        timeout=300,
    )
    # DagStateTrigger: GetDRCount, then GetDagRunState.
    TriggerDagRunOperator(
        task_id="trigger_target",
        trigger_dag_id="services_target",
        trigger_run_id="{{ run_id }}",
        wait_for_completion=True,
        deferrable=True,
        poke_interval=1,
    )
    # HttpSensorTrigger: GetConnection (async), then polls the test's endpoint.
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
    # HITLTrigger: GetHITLDetailResponse each poke, until the test answers "Approve" through
    # Airflow's REST API.
    ApprovalOnTrigger(task_id="approval", subject="Ship the services release?")
    # HITLTrigger's timeout: nobody answers; the trigger writes the default as the answer
    # (UpdateHITLDetail) and resumes the task with it.
    HITLOnTrigger(
        task_id="hitl_default",
        subject="Which colour?",
        options=["red", "green"],
        defaults="green",
        response_timeout=dt.timedelta(seconds=RESUME_AFTER + 5),
    )

# The fault test's: a trigger polling the variable while the bridge serving it goes away.
with DAG(dag_id="services_bridge_gone", schedule=None, start_date=START, default_args=ARGS):
    PollsVariableForever(task_id="polls_variable", key=VARIABLE_KEY)
