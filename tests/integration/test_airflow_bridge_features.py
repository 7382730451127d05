"""The bridge with Airflow 3's triggerer features, in a real Airflow 3.3 deployment.

One deployment for the module (scheduler, DAG processor, API server, LocalExecutor, SQLite),
with ``[triggerer] queues_enabled`` and ``[core] multi_team`` on, a team ``team_x`` whose DAGs
come from a bundle of their own (and run on a LocalExecutor of their own). No ``airflow
triggerer`` runs: each test starts bridges and deferline triggerers on a prefix of its own.

* **Trigger queues**: a deferral's row takes its task's queue. A bridge with ``--queues a``
  serves queue ``a`` only (``defer.a``); the queue ``b`` task stays deferred and unclaimed
  until a second bridge with ``--queues b`` serves it (``defer.b``).
* **start_from_trigger**: the scheduler writes the row and defers the task instance itself,
  with no worker run; the bridge serves it. One trigger fires into ``next_method`` (with the
  operator's ``next_kwargs``), one ends its task with a ``TaskSuccessEvent`` and XComs, and
  Airflow's ``DateTimeSensorAsync(start_from_trigger=True)`` resumes. Templated trigger
  kwargs are rendered by the bridge as Airflow's triggerer renders them (the DAG run's
  context; a variable stored in the database), before publishing; a template naming what
  the context lacks fails its task with the reason. A claim again (the first bridge stopped,
  the next claiming its rows) publishes the same bytes again.
* **Teams**: a bridge with ``--team team_x`` (on a prefix of the team's, with the team's
  triggerer) claims the team's row only; the row of a DAG in no team waits for a bridge
  without ``--team``. A bridge refuses ``--team`` and ``--queues`` where ``airflow
  triggerer`` refuses them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from deferline.schemas import DeferRequest, WatchRequest, decode, decode_as
from deferline.topics import Settings, TopicNames

from tests._until import until
from tests.airflow_line import airflow_version

from ._airflow_deployment import AirflowDeployment
from ._airflow_processes import Processes, reach, run_id_of, trigger_dag, xcom
from ._process import DEFERLINE
from ._util import KafkaClients

pytestmark = [
    pytest.mark.integration,
    pytest.mark.airflow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        airflow_version() < (3, 3),
        reason="trigger queues come with Airflow 3.2, teams with 3.3",
    ),
]

DAGS = Path(__file__).with_name("airflow_features_dags")
TEAM = "team_x"
MOMENT = "2026-01-01T00:00:00+00:00"  # the variable features_moment
ALLOWED = "features_triggers,airflow.providers.standard.triggers"


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowDeployment]:
    """Airflow 3.3 with trigger queues and teams on: the team's DAGs in a bundle of its own."""
    home = tmp_path_factory.mktemp("airflow")
    bundles = [
        {
            "name": "dags-folder",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {},
        },
        {
            "name": f"{TEAM}_dags",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(home / "dags" / TEAM)},
            "team_name": TEAM,
        },
    ]
    af = AirflowDeployment(
        home,
        extra_env={
            "AIRFLOW__TRIGGERER__QUEUES_ENABLED": "True",
            "AIRFLOW__CORE__MULTI_TEAM": "True",
            "AIRFLOW__CORE__EXECUTOR": f"LocalExecutor;{TEAM}=LocalExecutor",
            "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(bundles),
            "DEFERLINE_ALLOWED_TRIGGER_PREFIXES": ALLOWED,
        },
        dags_from=DAGS,
        before_start=[("teams", "create", TEAM), ("variables", "set", "features_moment", MOMENT)],
    )
    # A team's executor reads the team's own configuration (AIRFLOW__<TEAM>___<SECTION>__<KEY>).
    for key in ("CORE__EXECUTION_API_SERVER_URL", "WORKERS__EXECUTION_API_TIMEOUT"):
        af.env[f"AIRFLOW__{TEAM.upper()}___{key}"] = af.env[f"AIRFLOW__{key}"]
    try:
        af.start()
        af.wait_for(
            "SELECT count(*) FROM dag WHERE dag_id LIKE 'features_%' HAVING count(*) = 5",
            within=240,
        )
        yield af
    finally:
        af.close()


def state(af: AirflowDeployment, dag_id: str, run_id: str, task_id: str) -> str | None:
    return af.states(dag_id, run_id).get(task_id)


def trigger_rows(af: AirflowDeployment, dag_id: str, run_id: str) -> dict[str, tuple[object, ...]]:
    """Per deferred task: its trigger row's ``queue``, ``team_name`` and ``triggerer_id``."""
    rows = af.query(
        "SELECT ti.task_id, t.queue, t.team_name, t.triggerer_id FROM task_instance ti "
        "JOIN trigger t ON t.id = ti.trigger_id WHERE ti.dag_id = ? AND ti.run_id = ?",
        dag_id,
        run_id,
    )
    return {str(task): tuple(rest) for task, *rest in rows}


async def defer_requests(clients: KafkaClients, topic: str, run_id: str) -> dict[str, DeferRequest]:
    """The DeferRequests of ``run_id`` on ``topic`` now, by task id (the last of each)."""
    records = await defer_records(clients, topic, run_id)
    return {task_id: decode_as(values[-1], DeferRequest) for task_id, values in records.items()}


async def defer_records(clients: KafkaClients, topic: str, run_id: str) -> dict[str, list[bytes]]:
    """The DeferRequest records of ``run_id`` on ``topic`` now, by task id, in order: read
    from its start to its end offsets."""
    consumer = await clients.consumer()
    for _ in range(20):  # metadata of a topic this consumer has not named yet
        if consumer.partitions_for_topic(topic):
            break
        await consumer._client.force_metadata_update()
    partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
    assert partitions, f"no topic {topic}"
    consumer.assign(partitions)
    await consumer.seek_to_beginning(*partitions)
    ends = await consumer.end_offsets(partitions)
    found: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + 60

    async def behind() -> bool:
        return any([await consumer.position(tp) < end for tp, end in ends.items()])

    while await behind():
        assert time.monotonic() < deadline, f"{topic} not read to its end within 60 s"
        batches = await consumer.getmany(*partitions, timeout_ms=500)
        for message in (m for ms in batches.values() for m in ms):
            if message.value is not None:  # not a tombstone
                request = decode_as(message.value, DeferRequest)
                if request.task.run_id == run_id:
                    found.setdefault(request.task.task_id, []).append(message.value)
    return found


async def topics(clients: KafkaClients) -> set[str]:
    admin = await clients.admin()
    return set(await admin.list_topics())


async def test_each_bridge_serves_its_trigger_queues_only(
    airflow: AirflowDeployment,
    processes: Processes,
    settings: Settings,
    kafka_clients: KafkaClients,
) -> None:
    af, dag = airflow, "features_queues"
    run_id = run_id_of(settings, "queues")
    names = TopicNames(settings.topic_prefix)
    on_a = {"on_a_1", "on_a_2"}
    await trigger_dag(af, dag, run_id)
    await reach(af, dag, run_id, on_a | {"on_b"}, "deferred")
    # queues_enabled: each deferral's row took its task's queue.
    assert {t: row[0] for t, row in trigger_rows(af, dag, run_id).items()} == {
        "on_a_1": "a",
        "on_a_2": "a",
        "on_b": "b",
    }

    processes.bridge("bridge-a", "--queues", "a")
    processes.triggerer("triggerer-a", "--queues", "a")
    await reach(af, dag, run_id, on_a, "success")
    # Every claim loop of the bridge since the three deferred passed over queue b's row.
    assert state(af, dag, run_id, "on_b") == "deferred"
    assert trigger_rows(af, dag, run_id)["on_b"][2] is None  # claimed by no triggerer
    on_topics = await topics(kafka_clients)
    assert names.defer("a") in on_topics
    assert names.defer("b") not in on_topics  # no bridge has published to queue b
    requests_a = await defer_requests(kafka_clients, names.defer("a"), run_id)
    assert set(requests_a) == on_a
    assert {r.queue for r in requests_a.values()} == {"a"}

    processes.bridge("bridge-b", "--queues", "b")
    processes.triggerer("triggerer-b", "--queues", "b")
    await reach(af, dag, run_id, {"on_b"}, "success")
    requests_b = await defer_requests(kafka_clients, names.defer("b"), run_id)
    assert set(requests_b) == {"on_b"}
    assert requests_b["on_b"].queue == "b"
    assert set(await defer_requests(kafka_clients, names.defer("a"), run_id)) == on_a
    assert await defer_requests(kafka_clients, names.defer(), run_id) == {}
    for task_id in on_a | {"on_b"}:  # each resumed with its own trigger's event
        assert xcom(af, dag, run_id, task_id, "return_value") == f"fired for {task_id}"
    assert processes.dead() == []


async def test_a_task_started_from_its_trigger_runs_through_the_bridge(
    airflow: AirflowDeployment,
    processes: Processes,
    settings: Settings,
    kafka_clients: KafkaClients,
) -> None:
    af, dag = airflow, "features_start_from_trigger"
    run_id = run_id_of(settings, "start")
    ours = {"resumes_on_a_worker", "ends_in_the_trigger"}
    sensors = {"sensor_moment_passed", "sensor_templated", "sensor_templated_variable"}
    broken = "sensor_template_error"
    await trigger_dag(af, dag, run_id)
    await reach(af, dag, run_id, ours | sensors | {broken}, "deferred")
    # Deferred by the scheduler with no worker run: no task log, the first try,
    # start_trigger_args' method.
    for task_id in ours | sensors | {broken}:
        assert af.task_log(dag, task_id, run_id=run_id) == "", task_id
    rows = af.query(
        "SELECT task_id, try_number, next_method FROM task_instance "
        "WHERE dag_id = ? AND run_id = ?",
        dag,
        run_id,
    )
    assert sorted(rows) == sorted((t, 1, "execute_complete") for t in ours | sensors | {broken})
    # The scheduler's rows have no queue, even with queues_enabled (Airflow sets none there).
    assert {row[0] for row in trigger_rows(af, dag, run_id).values()} == {None}

    # A claim again publishes the same bytes: the first bridge publishes and stops (its job
    # ended, its rows free), the next one claims the rows and publishes them again.
    defer = TopicNames(settings.topic_prefix).defer()
    first = processes.bridge("bridge-1")

    async def published(times: int) -> dict[str, list[bytes]]:
        records: dict[str, list[bytes]] = {}

        async def enough() -> bool:
            nonlocal records
            if defer not in await topics(kafka_clients):  # the bridge creates it at start
                return False
            records = await defer_records(kafka_clients, defer, run_id)
            return set(records) == ours | sensors and all(len(r) >= times for r in records.values())

        await until(
            enough,
            within=120,
            interval=0.5,
            what=lambda: f"{defer} published {times}x (so far {sorted(records)})",
        )
        return records

    assert all(len(r) == 1 for r in (await published(1)).values())
    first.proc.terminate()
    assert await asyncio.to_thread(first.proc.wait, 60) == 0
    bridge = processes.bridge("bridge")
    for task_id, (once, again, *_) in (await published(2)).items():
        assert again == once, task_id
    processes.triggerer("triggerer")
    await reach(af, dag, run_id, ours | sensors, "success")
    await reach(af, dag, run_id, {broken}, "failed")
    # Fired into next_method: the worker's one run got the event and the operator's
    # next_kwargs (execute would have raised).
    assert (
        xcom(af, dag, run_id, "resumes_on_a_worker", "return_value")
        == "started in the trigger for resumes_on_a_worker | from start_trigger_args"
    )
    assert "start_from_trigger: execute must not run" not in af.task_log(
        dag, "resumes_on_a_worker", run_id=run_id
    )
    # Ended from the trigger: success and its XCom, and no worker ever ran it.
    assert xcom(af, dag, run_id, "ends_in_the_trigger", "fired") == (
        "started in the trigger for ends_in_the_trigger"
    )
    assert af.task_log(dag, "ends_in_the_trigger", run_id=run_id) == ""
    requests = await defer_requests(kafka_clients, defer, run_id)
    assert set(requests) == ours | sensors
    assert {(r.task.try_number, r.next_method) for r in requests.values()} == {
        (1, "execute_complete")
    }
    # Rendered before publishing: the DeferRequest carries what the template made of the
    # task's context, and of the variable in Airflow's database.
    [(run_after,)] = af.query(
        "SELECT run_after FROM dag_run WHERE dag_id = ? AND run_id = ?", dag, run_id
    )
    rendered = requests["sensor_templated"].kwargs["target_time"]
    stored = dt.datetime.fromisoformat(str(run_after))  # SQLite keeps it naive, in UTC
    stored = stored if stored.tzinfo else stored.replace(tzinfo=dt.UTC)
    assert dt.datetime.fromisoformat(rendered) == stored, (rendered, run_after)
    assert requests["sensor_templated_variable"].kwargs["target_time"] == MOMENT
    # A template naming what the context lacks: nothing published, the row failed saying
    # why, and the task with it (its worker, rendering the same field as it fails the task,
    # logs the same error, as after Airflow's triggerer).
    assert broken not in requests
    [failed] = [*first.find("trigger row failed"), *bridge.find("trigger row failed")]
    assert "templated kwargs could not be rendered" in failed["message"]
    assert "'no_such_thing' is undefined" in failed["message"]
    assert "'no_such_thing' is undefined" in af.task_log(dag, broken, run_id=run_id)
    assert processes.dead() == [str(first.log_path)]  # the one the test stopped


async def test_a_bridge_of_a_team_claims_that_teams_rows_only(
    airflow: AirflowDeployment,
    processes: Processes,
    settings: Settings,
    kafka_clients: KafkaClients,
) -> None:
    af = airflow
    run_id = run_id_of(settings, "teams")
    team_dag, global_dag = "features_team_x", "features_no_team"
    await asyncio.gather(trigger_dag(af, team_dag, run_id), trigger_dag(af, global_dag, run_id))
    await reach(af, team_dag, run_id, {"in_team_x"}, "deferred")
    await reach(af, global_dag, run_id, {"no_team"}, "deferred")
    # The rows carry their DAG bundle's team, and (queues_enabled) the tasks' queue, default.
    assert trigger_rows(af, team_dag, run_id)["in_team_x"][:2] == ("default", TEAM)
    assert trigger_rows(af, global_dag, run_id)["no_team"][:2] == ("default", None)

    # The team's own bridge and triggerer, on a prefix of the team's: its triggers run only
    # in the team's triggerers (with the team's connections and variables).
    team_prefix = f"{TEAM}."
    processes.bridge("bridge-team", "--team", TEAM, "--queues", "default", under=team_prefix)
    processes.triggerer("triggerer-team", under=team_prefix)  # the default queue
    await reach(af, team_dag, run_id, {"in_team_x"}, "success")
    assert state(af, global_dag, run_id, "no_team") == "deferred"
    assert trigger_rows(af, global_dag, run_id)["no_team"][2] is None  # claimed by no triggerer

    processes.bridge("bridge-no-team", "--queues", "default")
    processes.triggerer("triggerer-no-team")
    await reach(af, global_dag, run_id, {"no_team"}, "success")
    # Queue "default": the unsuffixed defer topic of each prefix.
    team_defer = TopicNames(processes.prefix(team_prefix)).defer()
    assert set(await defer_requests(kafka_clients, team_defer, run_id)) == {"in_team_x"}
    defer = TopicNames(processes.prefix()).defer()
    assert set(await defer_requests(kafka_clients, defer, run_id)) == {"no_team"}
    assert xcom(af, team_dag, run_id, "in_team_x", "return_value") == "fired for in_team_x"
    assert xcom(af, global_dag, run_id, "no_team", "return_value") == "fired for no_team"

    # The team's asset watcher row carries the team and no queue: as with `airflow triggerer`,
    # only a bridge of the team without --queues claims it, and publishes it on its prefix.
    [(watcher_team, watcher_queue)] = af.wait_for(
        "SELECT t.team_name, t.queue FROM trigger t JOIN asset_watcher w ON w.trigger_id = t.id "
        "WHERE w.name = 'team_x_watcher'"
    )
    assert (watcher_team, watcher_queue) == (TEAM, None)
    watchers_prefix = f"{TEAM}-watchers."
    processes.bridge("bridge-team-watchers", "--team", TEAM, under=watchers_prefix)
    watchers_defer = TopicNames(processes.prefix(watchers_prefix)).defer()

    async def published() -> list[WatchRequest]:
        return [
            r
            for r in await watch_requests(kafka_clients, watchers_defer)
            if r.classpath.endswith("FileDeleteTrigger")
        ]

    await until(published, within=120, what="the team's watcher published by the team's bridge")
    for other in (team_defer, defer):
        assert not await watch_requests(kafka_clients, other), f"no watch on {other}"
    assert processes.dead() == []


async def watch_requests(clients: KafkaClients, topic: str) -> list[WatchRequest]:
    """The WatchRequests on ``topic`` now (read from its start to its end offsets)."""
    consumer = await clients.consumer()
    await consumer._client.force_metadata_update()
    partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
    found: list[WatchRequest] = []
    if not partitions:  # the topic not made yet
        await consumer.stop()
        return found
    consumer.assign(partitions)
    await consumer.seek_to_beginning(*partitions)
    ends = await consumer.end_offsets(partitions)
    while any([await consumer.position(tp) < end for tp, end in ends.items()]):
        batches = await consumer.getmany(*partitions, timeout_ms=500)
        for message in (m for ms in batches.values() for m in ms):
            if message.value is not None:
                record = decode(message.value)
                if isinstance(record, WatchRequest):
                    found.append(record)
    await consumer.stop()
    return found


async def test_a_bridge_refuses_what_airflow_triggerer_refuses(airflow: AirflowDeployment) -> None:
    """A team filter Airflow's claim would ignore (the bridge would claim every team's rows),
    a team Airflow does not have, queues Airflow never sets: refused at start."""
    cases = {
        "--team needs Airflow's [core] multi_team": (
            ("--team", TEAM),
            {"AIRFLOW__CORE__MULTI_TEAM": "False"},
        ),
        "Airflow has no team 'no_such_team'": (("--team", "no_such_team"), {}),
        "--queues needs Airflow's [triggerer] queues_enabled": (
            ("--queues", "a"),
            {"AIRFLOW__TRIGGERER__QUEUES_ENABLED": "False"},
        ),
    }

    def start(args: tuple[str, ...], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [DEFERLINE, "airflow", "bridge", "--bootstrap-servers", "127.0.0.1:9", *args],
            env={**airflow.env, **env},
            capture_output=True,
            timeout=120,
            check=False,
        )

    done = await asyncio.gather(*(asyncio.to_thread(start, *case) for case in cases.values()))
    for reason, result in zip(cases, done, strict=True):
        assert result.returncode == 2, (reason, result.stderr.decode())
        assert reason in result.stderr.decode()
