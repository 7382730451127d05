"""Airflow triggers that ask Airflow's runtime for what only its database knows, through the
bridge's Airflow services, in a real Airflow 3.3 deployment.

One deployment for the module (scheduler, DAG processor, API server, LocalExecutor, SQLite);
no ``airflow triggerer``. A bridge with ``--services-port`` and one deferline triggerer with
``DEFERLINE_AIRFLOW_SERVICES`` pointing at it, on a prefix of the test's own. The triggerer
gets none of Airflow's database settings: an ``AIRFLOW_HOME`` of its own, no
``AIRFLOW__DATABASE__*``, no ``AIRFLOW_CONN_*`` / ``AIRFLOW_VAR_*``. The connection and the
variable live only in Airflow's database (``airflow connections add`` / ``airflow variables
set``). Each task ends as it ends with ``airflow triggerer``:

* ``ExternalTaskSensor(deferrable=True)`` (``WorkflowTrigger``: task-instance counts) waits
  for a task of another DAG's run of the same logical date, which ends after the sensor
  deferred: success.
* ``TriggerDagRunOperator(wait_for_completion=True, deferrable=True)`` (``DagStateTrigger``:
  DAG-run count and state) waits for the run it started: success, and so does that run.
* ``HttpSensor(deferrable=True)`` (``HttpSensorTrigger``) on a connection stored in the
  database, polling a local endpoint that answers 404 until the test makes it answer 200:
  success, after several polls.
* A user's trigger calling ``Variable.get`` synchronously inside ``async def run()``: the
  task resumes with the variable's value (its ``next_method`` checks it against the value
  Airflow's worker reads): success, the value as its XCom.
* A user's trigger reading a connection that exists nowhere: the task fails, its log with
  Airflow's own "isn't defined" error.
* The standard provider's ``ApprovalOperator`` and ``HITLOperator`` deferring on ``HITLTrigger``
  (as the provider's operators do before Airflow 3.3; 3.3 parks them in ``awaiting_input``,
  with no trigger): the test answers the approval "Approve" as a user does, through Airflow's
  REST API with a token of the API server's: success, the answer as its XCom. Nobody answers
  the other: at its timeout its trigger writes the default as the answer (UpdateHITLDetail)
  and the task succeeds with it.

And a fault: the bridge stops (SIGTERM) while a trigger polls a variable through it. With
``DEFERLINE_AIRFLOW_SERVICES_TIMEOUT=3`` the trigger's next request fails after 3 s with
``AirflowServicesUnavailable`` naming the server; the next bridge writes the failure back and
the task fails with that error in its log.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from deferline.topics import Settings, free_port

from tests._until import until
from tests.airflow_line import airflow_version

from ._airflow_deployment import AirflowDeployment
from ._airflow_processes import Processes, reach, run_id_of, trigger_dag, xcom
from ._services_kit import (
    MISSING_CONN_ID,
    VARIABLE_VALUE,
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
        airflow_version() < (3, 3),
        reason="the bridge's Airflow services answer Airflow 3's trigger requests (2.10's "
        "triggers read the database themselves); tested on 3.3, the airflow extra's Airflow",
    ),
]

DAGS = Path(__file__).with_name("airflow_services_dags")
ALLOWED = "services_triggers,airflow.providers.standard.triggers,airflow.providers.http.triggers"
GATE_ENV = "SERVICES_TEST_GATE"  # services_ops.GATE_ENV
# A user of the API server (SimpleAuthManager, Airflow's default), who answers the
# human-in-the-loop request; its password is in the deployment's passwords file.
REVIEWER = "reviewer"
PASSWORDS_FILE_ENV = "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"
# No trigger may fire sooner than this after its task deferred (docs/airflow.md, the race).
RESUME_AFTER = 15
FINAL = {"success", "failed", "skipped", "upstream_failed"}


@pytest.fixture(scope="module")
def airflow(
    tmp_path_factory: pytest.TempPathFactory, endpoint: Endpoint
) -> Iterator[AirflowDeployment]:
    """Airflow 3.3 with the test's connection and variable in its database, and nowhere else."""
    home = tmp_path_factory.mktemp("airflow")
    passwords = home / "passwords.json"
    passwords.write_text(json.dumps({REVIEWER: secrets.token_urlsafe(16)}))
    af = AirflowDeployment(
        home,
        extra_env={
            GATE_ENV: str(home / "gate"),
            "DEFERLINE_ALLOWED_TRIGGER_PREFIXES": ALLOWED,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{REVIEWER}:user",
            PASSWORDS_FILE_ENV: str(passwords),
        },
        dags_from=DAGS,
        before_start=stored_in_database(endpoint),
    )
    try:
        af.start()
        af.wait_for(
            "SELECT count(*) FROM dag WHERE dag_id LIKE 'services%' HAVING count(*) = 4",
            within=240,
        )
        yield af
    finally:
        af.close()


def api(af: AirflowDeployment, method: str, path: str, body: Any = None, token: str = "") -> Any:
    """One call to the REST API of the deployment's API server; its JSON answer."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{af.env['AIRFLOW__API__PORT']}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}
        | ({"Authorization": f"Bearer {token}"} if token else {}),
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        pytest.fail(f"{method} {path}: {exc.code} {exc.read().decode(errors='replace')}")


def reviewer_token(af: AirflowDeployment) -> str:
    """``REVIEWER``'s token, as a client logs in to the API server."""
    password = json.loads(Path(af.env[PASSWORDS_FILE_ENV]).read_text())[REVIEWER]
    answer = api(af, "POST", "/auth/token", {"username": REVIEWER, "password": password})
    return str(answer["access_token"])


def hitl_path(dag_id: str, run_id: str, task_id: str) -> str:
    """The public API's human-in-the-loop detail of a task instance (no map index)."""
    return f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/-1/hitlDetails"


def logged_at(line: dict[str, Any]) -> float:
    """When a deferline process logged ``line`` (its ``time`` field), in seconds."""
    return dt.datetime.strptime(str(line["time"]), "%Y-%m-%d %H:%M:%S,%f").timestamp()


async def test_airflow_triggers_get_what_only_airflows_database_knows(
    airflow: AirflowDeployment,
    endpoint: Endpoint,
    processes: Processes,
    settings: Settings,
    tmp_path: Path,
) -> None:
    af = airflow
    run_id = f"services-{settings.topic_prefix.rstrip('.')}"
    # The sensor waits for the upstream run of its own logical date.
    logical_date = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()
    gated = {"external_sensor", "trigger_target", "http_sensor"}
    hitl = {"approval", "hitl_default"}  # answered through the REST API; by its timeout
    succeed = gated | hitl | {"reads_variable"}

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
    triggerer = processes.triggerer("triggerer", env=trigger_env)
    database_seen, *_ = await asyncio.gather(
        asyncio.to_thread(airflow_database_of, trigger_env),
        trigger_dag(af, "services_upstream", run_id, logical_date=logical_date),
        trigger_dag(af, "services", run_id, logical_date=logical_date),
    )
    # Airflow, imported with the triggerer's environment, knows no way to the deployment's
    # database (its default: a file in the triggerer's own AIRFLOW_HOME).
    assert str(af.db_path) not in database_seen
    assert str(af.home) not in database_seen

    # The gated tasks stay deferred until the test opens the gate: the upstream task and the
    # triggered DAG's task run meanwhile, the endpoint answers 404. The approval waits for
    # its answer.
    await reach(af, "services", run_id, gated | hitl, "deferred")
    deferred_at = time.monotonic()
    await reach(af, "services_upstream", run_id, {"upstream_task"}, "running")
    await reach(af, "services_target", run_id, {"target_task"}, "running")
    # The request, as a user finds it: not answered yet.
    approval = hitl_path("services", run_id, "approval")
    token = await asyncio.to_thread(reviewer_token, af)
    request = await asyncio.to_thread(api, af, "GET", approval, token=token)
    assert request["subject"] == "Ship the services release?", request
    assert request["options"] == ["Approve", "Reject"], request
    assert not request["response_received"], request
    await asyncio.sleep(max(0.0, deferred_at + RESUME_AFTER - time.monotonic()))
    waiting = gated | {"approval"}
    assert {t: s for t, s in af.states("services", run_id).items() if t in waiting} == (
        dict.fromkeys(waiting, "deferred")
    )
    # The answer first: the gate's tasks all end at once after, each a write to SQLite.
    answer = await asyncio.to_thread(
        api, af, "PATCH", approval, {"chosen_options": ["Approve"]}, token
    )
    assert answer["chosen_options"] == ["Approve"], answer
    assert answer["responded_by"] == {"id": REVIEWER, "name": REVIEWER}, answer
    endpoint.ready.set()
    await asyncio.to_thread(Path(af.env[GATE_ENV]).touch)

    await reach(af, "services", run_id, succeed | {"missing_connection"}, FINAL)
    states = af.states("services", run_id)
    assert states == {**dict.fromkeys(succeed, "success"), "missing_connection": "failed"}, states
    assert af.states("services_upstream", run_id) == {"upstream_task": "success"}
    assert af.states("services_target", run_id) == {"target_task": "success"}
    await dag_run_reaches(af, "services_upstream", run_id, "success")
    await dag_run_reaches(af, "services_target", run_id, "success")

    # HttpSensor: the worker's poke and the trigger's polls got 404, then the trigger a 200.
    assert endpoint.answers[-1] == 200
    assert endpoint.answers.index(200) >= 3, endpoint.answers

    # The variable, read by the trigger through the bridge, checked against the worker's.
    assert xcom(af, "services", run_id, "reads_variable", "return_value") == VARIABLE_VALUE

    # The approval: the user's answer, as the operator returns it.
    approved = xcom(af, "services", run_id, "approval", "return_value")
    assert isinstance(approved, dict), approved
    assert approved["chosen_options"] == ["Approve"], approved
    assert approved["responded_by_user"] == {"id": REVIEWER, "name": REVIEWER}, approved
    # Nobody answered the other: its trigger wrote the default as the answer (no user), through
    # the bridge, and the task resumed with it.
    defaulted = xcom(af, "services", run_id, "hitl_default", "return_value")
    assert isinstance(defaulted, dict), defaulted
    assert defaulted["chosen_options"] == ["green"], defaulted
    assert defaulted["responded_by_user"] is None, defaulted
    detail = api(af, "GET", hitl_path("services", run_id, "hitl_default"), token=token)
    assert detail["response_received"], detail
    assert detail["chosen_options"] == ["green"], detail
    assert detail["responded_by_user"] is None, detail
    assert triggerer.find("[HITL] timeout reached before receiving response"), triggerer.log_path
    assert requests_answered(metrics_port, "GetHITLDetailResponse") >= 2
    assert requests_answered(metrics_port, "UpdateHITLDetail") == 1

    # A connection that exists nowhere: Airflow's own error, in the task's log.
    log = af.task_log("services", "missing_connection", run_id=run_id)
    assert "Trigger failure" in log
    assert f"The conn_id `{MISSING_CONN_ID}` isn't defined" in log

    assert services_of(bridge) == [services_port]
    # Nothing opened a database where the triggerer's Airflow would look for one.
    assert not (trigger_home / "airflow.db").exists()
    assert processes.dead() == []


async def test_a_trigger_fails_when_its_bridge_is_gone(
    airflow: AirflowDeployment, processes: Processes, settings: Settings, tmp_path: Path
) -> None:
    """The bridge serving a trigger's requests stops while the trigger polls a variable: the
    next request fails after ``DEFERLINE_AIRFLOW_SERVICES_TIMEOUT`` with
    ``AirflowServicesUnavailable`` naming the server, and a second bridge (it serves the
    resume topic) fails the task with it."""
    af, dag, task = airflow, "services_bridge_gone", "polls_variable"
    run_id = run_id_of(settings, "gone")
    services_port = free_port()
    services = f"http://127.0.0.1:{services_port}"
    trigger_env = triggerer_environment(af, tmp_path / "triggerer_home", services, ALLOWED)
    trigger_env["DEFERLINE_AIRFLOW_SERVICES_TIMEOUT"] = "3"

    bridge = processes.bridge(
        "bridge", "--services-port", str(services_port), "--services-host", "127.0.0.1"
    )
    triggerer = processes.triggerer("triggerer", env=trigger_env)
    await trigger_dag(af, dag, run_id)
    await reach(af, dag, run_id, {task}, "deferred")
    deferred_at = time.monotonic()

    def polls() -> int:
        return len(triggerer.find("polled variable"))

    # The trigger reads the variable through the bridge, once a second.
    await until(
        partial(asyncio.to_thread, lambda: polls() >= 2),
        within=60,
        interval=0.5,
        what="the trigger polled the variable twice",
    )
    await asyncio.sleep(max(0.0, deferred_at + RESUME_AFTER - time.monotonic()))
    bridge.proc.terminate()
    assert await asyncio.to_thread(bridge.proc.wait, 60) == 0

    def failures() -> list[dict[str, Any]]:
        return triggerer.find("trigger failed")

    await until(
        partial(asyncio.to_thread, lambda: bool(failures())),
        within=60,
        interval=0.5,
        what="the trigger failed",
    )
    (failure,) = failures()
    message = str(failure["message"])
    assert "AirflowServicesUnavailable" in message, message
    assert services in message, message
    # The request under way when the bridge went was retried for the timeout, then failed.
    last_poll = triggerer.find("polled variable")[-1]
    assert logged_at(failure) - logged_at(last_poll) >= 2.9, (last_poll, failure)

    # The failed event waits on the resume topic for a bridge: the next one writes it back.
    processes.bridge("bridge-2")
    await reach(af, dag, run_id, {task}, "failed")
    log = af.task_log(dag, task, run_id=run_id)
    assert "Trigger failure" in log
    assert "AirflowServicesUnavailable" in log
    assert services in log
    assert processes.dead() == [str(bridge.log_path)]  # the one the test stopped
