"""Airflow's own trigger classes, unmodified, end to end on a real broker.

A worker (in this process) runs deferline operators that ``self.defer(trigger=...)`` on
Airflow's ``DateTimeTrigger``, ``TimeDeltaTrigger``, ``FileTrigger``, the HTTP provider's
``HttpSensorTrigger`` and ``HttpTrigger`` (against a local aiohttp server, connection from an
``AIRFLOW_CONN_*`` variable), a user's trigger written against Airflow's ``BaseTrigger`` that
reads an ``AIRFLOW_VAR_*`` variable (and ends its task with a ``TaskSuccessEvent`` carrying
XComs), one whose ``on_kill()`` runs when its task is cleared, and ``WorkflowTrigger`` (needs
Airflow's database); a ``deferline triggerer`` process
runs the triggers; the scheduler folds the events. Each payload is compared with what the
same Airflow class yields when run directly here. Runs on whichever Airflow line is installed
(``make test`` runs it on both).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from deferline.client import Client
from deferline.engine import preload_airflow
from deferline.runners.scheduler import Scheduler
from deferline.runners.worker import Worker
from deferline.schemas import TaskKey, TaskStateRecord, TriggerEventRecord, make_trigger_id
from deferline.topics import Settings

from tests.airflow_line import STANDARD_TRIGGERS, airflow_line

from ._taskflow import TaskFlow
from ._triggerer_help import TriggererProcess

pytestmark = [pytest.mark.integration, pytest.mark.airflow, pytest.mark.timeout(180)]

# Imported by the worker only: importing it here would import Airflow during collection.
OPS = "tests.integration._airflow_ops"
HTTP_CONN_ID = "deferline_test_api"  # _airflow_ops.HTTP_CONN_ID
GREETING_VAR = "deferline_test_greeting"  # _airflow_ops.GREETING_VAR
AIRFLOW_TRIGGERS = f"{STANDARD_TRIGGERS},airflow.providers.http.triggers,{OPS}"


@contextlib.asynccontextmanager
async def http_api() -> AsyncIterator[tuple[str, dict[str, bool]]]:
    """``/ready`` answers 404 until ``state["ready"]``; ``/data`` answers JSON."""
    state = {"ready": False}

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ok") if state["ready"] else web.Response(status=404)

    async def data(request: web.Request) -> web.Response:
        return web.json_response({"rows": 3})

    app = web.Application()
    app.router.add_get("/ready", ready)
    app.router.add_get("/data", data)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", state
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def triggerer_process(settings: Settings, workdir: Path, api: str) -> Iterator[TriggererProcess]:
    """A ``deferline triggerer`` allowed Airflow's triggers, with the API's connection and a
    variable in its environment (kept in this process too, to run the classes directly)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(f"AIRFLOW_CONN_{HTTP_CONN_ID.upper()}", api)
        env.setenv(f"AIRFLOW_VAR_{GREETING_VAR.upper()}", "hello from the environment")
        with pytest.MonkeyPatch.context() as child_env:
            child_env.setenv("DEFERLINE_ALLOWED_TRIGGER_PREFIXES", AIRFLOW_TRIGGERS)
            # GreetingTrigger's module is in this repository's tests package.
            child_env.setenv("PYTHONPATH", str(Path(__file__).parents[2]), prepend=os.pathsep)
            child_env.setenv("HOME", str(workdir / "home"))  # so a write under HOME would show
            child_env.delenv("AIRFLOW_HOME", raising=False)
            (workdir / "home").mkdir()
            process = TriggererProcess(settings, "airflow-t1", workdir)
        try:
            yield process
        finally:
            process.close()


async def run_directly(trigger: Any) -> list[Any]:
    """The events an Airflow trigger yields run by itself (no deferline), ``cleanup()`` after."""

    async def run() -> list[Any]:
        try:
            return [event async for event in trigger.run()]
        finally:
            await trigger.cleanup()

    return await asyncio.wait_for(run(), 30)


def payloads(flow: TaskFlow, task: TaskKey) -> list[tuple[str, Any]]:
    trigger_id = make_trigger_id(task, 0)
    return [(e.status, e.payload) for e in flow.events if e.trigger_id == trigger_id]


def xcom(record: TaskStateRecord) -> Any:
    assert record.xcoms is not None, record
    return record.xcoms["return_value"]


async def test_airflow_triggers_run_unchanged_end_to_end(
    settings: Settings, tmp_path: Path
) -> None:
    settings = settings.model_copy(
        update={
            "allowed_trigger_prefixes": AIRFLOW_TRIGGERS.split(","),
            "allowed_operator_prefixes": [OPS],
        }
    )
    watched = tmp_path / "drop" / "ready.csv"
    watched.parent.mkdir()
    async with (
        http_api() as (api, api_state),
        TaskFlow(settings) as flow,
        Scheduler(settings, orphan_check_interval=0.5, commit_interval=0.2) as scheduler,
        Worker(settings, slots=8, poll_interval=0.02, graceful_timeout=5.0),
        Client(settings) as client,
    ):
        await scheduler.wait_ready()
        with triggerer_process(settings, tmp_path, api) as triggerer:

            async def submit(name: str, operator: str, **op_kwargs: Any) -> TaskKey:
                return await client.submit(
                    f"{OPS}.{operator}",
                    dag_id="airflow",
                    task_id=name,
                    run_id="run1",
                    op_kwargs=op_kwargs,
                )

            until = await submit("until", "WaitUntil", seconds=0.5)
            delta = await submit("delta", "WaitFor", seconds=0.5)
            ended = await submit("ended", "EndsFromTrigger")
            file = await submit("file", "WaitForFile", path=str(watched))
            sensor = await submit("sensor", "WaitForEndpoint")
            call = await submit("call", "CallEndpoint")
            greets = await submit("greets", "Greets")
            greeted = await submit("greeted", "EndsWithGreeting")
            other_dag = await submit("other_dag", "WaitForOtherDag")
            journal = tmp_path / "external-job.txt"
            watcher = await submit("watcher", "WatchesExternalJob", journal=str(journal))
            # Airflow as the triggerer loads it (as a library, no database) to run classes here.
            assert preload_airflow(AIRFLOW_TRIGGERS.split(","))
            ops: Any = importlib.import_module(OPS)

            # DateTimeTrigger: the payload is what Airflow's class yields, the moment.
            done = await flow.wait_state(until, "success", within=60)
            moment = xcom(done)["moment"]
            [direct] = await run_directly(ops.DateTimeTrigger(moment))
            assert payloads(flow, until) == [("fired", direct.payload)]
            assert xcom(done)["event"] == moment

            # TimeDeltaTrigger is a DateTimeTrigger due at now + delta.
            done = await flow.wait_state(delta, "success", within=60)
            event = xcom(done)["event"]
            assert isinstance(event, dt.datetime)
            [direct] = await run_directly(ops.DateTimeTrigger(event))
            assert payloads(flow, delta) == [("fired", direct.payload)]

            # end_from_trigger: Airflow's TaskSuccessEvent ends the task without a worker.
            done = await flow.wait_state(ended, "success", within=60)
            assert done.source == "scheduler"
            assert flow.runs_of(ended, "resume") == []

            # FileTrigger and HttpSensorTrigger wait, then fire with what the class yields.
            await flow.wait_state(file, "deferred")
            await flow.wait_state(sensor, "deferred")
            assert flow.latest(file).state == "deferred"  # type: ignore[union-attr]
            watched.write_text("a,b\n")
            api_state["ready"] = True
            direct_runs = {
                file: ops.FileTrigger(str(watched), poke_interval=0.1),
                sensor: ops.HttpSensorTrigger(
                    endpoint="ready", http_conn_id=HTTP_CONN_ID, poke_interval=0.1
                ),
            }
            for task, trigger in direct_runs.items():
                done = await flow.wait_state(task, "success", within=60)
                [direct] = await run_directly(trigger)
                assert payloads(flow, task) == [("fired", direct.payload)]
                assert xcom(done) == {"event": direct.payload}

            # HttpTrigger: the connection came from AIRFLOW_CONN_*; the payload is Airflow's.
            done = await flow.wait_state(call, "success", within=60)
            assert xcom(done) == {"status": "success", "code": 200, "json": {"rows": 3}}
            [(status, payload)] = payloads(flow, call)
            [direct] = await run_directly(
                ops.HttpTrigger(http_conn_id=HTTP_CONN_ID, method="GET", endpoint="data")
            )
            assert status == "fired"
            assert sorted(payload) == sorted(direct.payload) == ["response", "status"]

            # A user's trigger on Airflow's BaseTrigger, reading a variable from AIRFLOW_VAR_*.
            done = await flow.wait_state(greets, "success", within=60)
            [direct] = await run_directly(ops.GreetingTrigger(GREETING_VAR))
            assert direct.payload == {"greeting": "hello from the environment"}
            assert payloads(flow, greets) == [("fired", direct.payload)]
            assert xcom(done) == {"event": direct.payload}

            # Its TaskSuccessEvent ends the task with the trigger's XComs.
            done = await flow.wait_state(greeted, "success", within=60)
            [direct] = await run_directly(ops.GreetingTrigger(GREETING_VAR, end_from_trigger=True))
            assert done.source == "scheduler"
            assert done.xcoms == direct.xcoms == {"greeting": "hello from the environment"}
            assert flow.runs_of(greeted, "resume") == []

            # WorkflowTrigger needs Airflow's database: a clear failure, the task fails.
            failed = await flow.wait_state(other_dag, "failed", within=60)
            assert failed.reason is not None
            assert "metadata database" in failed.reason, failed.reason
            [failure] = [e for e in flow.events if e.trigger_id == make_trigger_id(other_dag, 0)]
            assert isinstance(failure, TriggerEventRecord)
            assert failure.status == "failed"
            assert failure.error is not None
            assert failure.error.startswith("AirflowDatabaseUnavailable: "), failure.error
            assert f"{STANDARD_TRIGGERS}.external_task.WorkflowTrigger" in failure.error
            if airflow_line() >= 3:  # asked through the supervisor's channel, named
                assert "GetTICount" in failure.error, failure.error

            # Clearing a task (``deferline clear``) cancels its trigger: on_kill(), then cleanup().
            def journal_says() -> list[str]:
                return journal.read_text().split() if journal.exists() else []

            await flow.wait_for(lambda: journal_says() == ["run"], within=60)
            await client.clear(watcher)
            await flow.wait_for(lambda: len(journal_says()) == 3, within=30)
            assert journal_says() == ["run", "on_kill", "cleanup"]
            [cancelled] = await flow.wait_for(
                lambda: [e for e in flow.events if e.trigger_id == make_trigger_id(watcher, 0)]
            )
            assert cancelled.status == "cancelled"

            assert scheduler.table.counters.events_duplicate == 0
            assert triggerer.proc.poll() is None, "the triggerer process kept running"
            assert triggerer.find("Airflow loaded"), "loaded before joining the group"
            # An Airflow trigger's own ``self.log`` lands in the triggerer's (JSON) log.
            logged = triggerer.find("read variable deferline_test_greeting")
            assert logged, "GreetingTrigger's log line reached the triggerer's log"
            assert logged[0].get("logger") == f"{OPS}.GreetingTrigger", logged
            assert list((tmp_path / "home").rglob("*")) == [], "nothing written under HOME"
