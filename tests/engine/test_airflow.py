"""Airflow's own trigger classes under deferline's loader and adapter (needs the airflow extra).

Tests that must see a clean interpreter (what gets imported, what gets written) run in a
subprocess; the others import Airflow here, as a library, the way the loader does.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from deferline.engine import (
    AirflowDatabaseUnavailable,
    BaseOperator,
    BaseTrigger,
    Context,
    TaskDeferred,
    TaskFailureEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
    TriggerEvent,
    TriggerNotAllowed,
    deferral_records,
    load_trigger,
)
from deferline.engine._airflow import prepare_airflow_import, to_deferline_event
from deferline.schemas import (
    DeferRequest,
    TaskKey,
    decode,
    dumps_value,
    encode,
    loads_value,
    utcnow,
)

pytestmark = [pytest.mark.airflow, pytest.mark.timeout(60)]

AIRFLOW_PREFIXES = ["airflow.triggers", "airflow.providers.http.triggers"]


def run_python(code: str, tmp_path: Path, **env: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter with HOME in ``tmp_path``; it prints one JSON line."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))} | {
        "HOME": str(home),
        **env,
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_deferline_imports_no_airflow(tmp_path: Path) -> None:
    """Every deferline package, a built-in trigger and a refused Airflow classpath: no Airflow."""
    result = run_python(
        """
        import json, sys
        import deferline.client, deferline.engine, deferline.engine.examples
        import deferline.engine.triggers, deferline.replay, deferline.runners.cli
        import deferline.runners.scheduler, deferline.runners.triggerer, deferline.runners.worker
        import deferline.schemas, deferline.topics
        from deferline.engine import TriggerNotAllowed, load_trigger, preload_airflow
        from deferline.schemas import utcnow
        assert not preload_airflow(["deferline.engine.triggers", "airflowish.triggers"])
        load_trigger("deferline.engine.triggers.DateTimeTrigger", {"moment": utcnow()},
                     allowed_prefixes=["deferline.engine.triggers"])
        try:
            load_trigger("airflow.triggers.temporal.DateTimeTrigger", {"moment": utcnow()},
                         allowed_prefixes=["deferline.engine.triggers"])
            refused = False
        except TriggerNotAllowed:
            refused = True
        print(json.dumps({"refused": refused,
                          "airflow": sorted(m for m in sys.modules if m.startswith("airflow"))}))
        """,
        tmp_path,
    )
    assert result == {"refused": True, "airflow": []}


def test_loading_an_airflow_trigger_leaves_logging_home_and_database_alone(
    tmp_path: Path,
) -> None:
    """Airflow loads as a library: root logging handlers kept, nothing written under HOME,
    no ORM engine; its session factory is deferline's guard."""
    result = run_python(
        """
        import json, logging, os, sys
        handler = logging.StreamHandler(sys.stderr)
        logging.getLogger().addHandler(handler)
        from deferline.engine import load_trigger, preload_airflow
        from deferline.schemas import utcnow
        assert preload_airflow(["deferline.engine.triggers", "airflow.triggers."])
        assert "airflow.models.dag" in sys.modules
        trigger = load_trigger("airflow.triggers.temporal.DateTimeTrigger", {"moment": utcnow()},
                               allowed_prefixes=["airflow.triggers"])
        import airflow.settings
        files = [str(p) for p in __import__("pathlib").Path(os.environ["HOME"]).rglob("*")]
        print(json.dumps({
            "handlers_kept": logging.getLogger().handlers == [handler],
            "files_in_home": files,
            "engine": repr(airflow.settings.engine),
            "session": airflow.settings.Session.__name__,
            "classpath": trigger.serialize()[0],
        }))
        """,
        tmp_path,
    )
    assert result == {
        "handlers_kept": True,
        "files_in_home": [],
        "engine": "None",
        "session": "_NoDatabaseSession",
        "classpath": "airflow.triggers.temporal.DateTimeTrigger",
    }


@pytest.fixture(scope="module")
def airflow() -> Any:
    """Airflow imported here the way the loader imports it (as a library)."""
    prepare_airflow_import()
    import airflow.triggers.base

    return airflow


def test_events_map_onto_deferline_events(airflow: Any) -> None:
    from airflow.triggers import base

    moment = utcnow()
    assert to_deferline_event(base.TriggerEvent(moment)) == TriggerEvent(moment)
    assert to_deferline_event(base.TriggerEvent({"status": "success"})).payload == {
        "status": "success"
    }
    success = to_deferline_event(base.TaskSuccessEvent(xcoms={"out": 1}))
    assert success == TaskSuccessEvent(xcoms={"out": 1})
    assert success.payload == "success"
    assert to_deferline_event(base.TaskFailedEvent()) == TaskFailureEvent()
    assert to_deferline_event(base.TaskSkippedEvent()) == TaskSkippedEvent()
    with pytest.raises(TypeError, match="not a TriggerEvent"):
        to_deferline_event(object())


async def collect(trigger: BaseTrigger) -> list[TriggerEvent]:
    events = []
    try:
        async for event in trigger.run():
            events.append(event)
    finally:
        await trigger.cleanup()
    return events


def load(classpath: str, **kwargs: Any) -> BaseTrigger:
    return load_trigger(classpath, kwargs, allowed_prefixes=AIRFLOW_PREFIXES)


async def test_temporal_triggers_fire_with_the_moment(airflow: Any) -> None:
    from airflow.triggers.temporal import TimeDeltaTrigger

    moment = utcnow() + dt.timedelta(seconds=0.2)
    trigger = load("airflow.triggers.temporal.DateTimeTrigger", moment=moment)
    assert trigger.serialize() == (
        "airflow.triggers.temporal.DateTimeTrigger",
        {"moment": moment, "end_from_trigger": False},
    )
    assert await collect(trigger) == [TriggerEvent(moment)]

    # TimeDeltaTrigger serializes itself as a DateTimeTrigger, as in Airflow.
    classpath, kwargs = TimeDeltaTrigger(dt.timedelta(seconds=0.1)).serialize()
    assert classpath == "airflow.triggers.temporal.DateTimeTrigger"
    rebuilt = load(classpath, **loads_value(dumps_value(kwargs)))
    assert await collect(rebuilt) == [TriggerEvent(kwargs["moment"])]

    ended = load(
        "airflow.triggers.temporal.DateTimeTrigger", moment=utcnow(), end_from_trigger=True
    )
    assert await collect(ended) == [TaskSuccessEvent()]


async def test_file_trigger_fires_true_once_the_file_exists(airflow: Any, tmp_path: Path) -> None:
    target = tmp_path / "ready.csv"
    trigger = load(
        "airflow.triggers.file.FileTrigger", filepath=str(tmp_path / "*.csv"), poke_interval=0.05
    )
    run = asyncio.create_task(collect(trigger))
    await asyncio.sleep(0.2)
    assert not run.done(), "fired before the file existed"
    target.write_text("x")
    assert await asyncio.wait_for(run, 10) == [TriggerEvent(True)]


@pytest.fixture
async def http_server() -> AsyncIterator[tuple[str, dict[str, bool]]]:
    """A local HTTP server: ``/ready`` answers 404 until ``state["ready"]``; ``/data`` is JSON."""
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
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        await runner.cleanup()


async def test_http_triggers_take_their_connection_from_the_environment(
    airflow: Any, http_server: tuple[str, dict[str, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, state = http_server
    monkeypatch.setenv("AIRFLOW_CONN_LOCAL_API", url)
    sensor = load(
        "airflow.providers.http.triggers.http.HttpSensorTrigger",
        endpoint="ready",
        http_conn_id="local_api",
        poke_interval=0.05,
    )
    run = asyncio.create_task(collect(sensor))
    await asyncio.sleep(0.3)
    assert not run.done(), "fired while the endpoint answered 404"
    state["ready"] = True
    assert await asyncio.wait_for(run, 10) == [TriggerEvent(True)]

    call = load(
        "airflow.providers.http.triggers.http.HttpTrigger",
        http_conn_id="local_api",
        method="GET",
        endpoint="data",
    )
    [event] = await collect(call)
    assert event.payload["status"] == "success", event.payload
    response = pickle.loads(base64.standard_b64decode(event.payload["response"]))
    assert (response.status_code, response.json()) == (200, {"rows": 3})


async def test_trigger_needing_the_database_fails_with_the_reason(airflow: Any) -> None:
    trigger = load(
        "airflow.triggers.external_task.WorkflowTrigger",
        external_dag_id="other",
        execution_dates=[utcnow()],
        external_task_ids=["t"],
        allowed_states=["success"],
        poke_interval=0.05,
    )
    with pytest.raises(AirflowDatabaseUnavailable, match="metadata database") as caught:
        await collect(trigger)
    assert "airflow.triggers.external_task.WorkflowTrigger" in str(caught.value)
    assert caught.value.__cause__ is None


def test_airflow_trigger_needs_an_allowed_prefix(airflow: Any) -> None:
    with pytest.raises(TriggerNotAllowed, match="not under an allowed module prefix"):
        load_trigger(
            "airflow.triggers.temporal.DateTimeTrigger",
            {"moment": utcnow()},
            allowed_prefixes=["airflow.providers"],
        )


def test_operator_defers_on_an_airflow_trigger(airflow: Any) -> None:
    """``self.defer(trigger=DateTimeTrigger(...))``: Airflow's serialize() output travels."""
    from airflow.triggers.temporal import DateTimeTrigger

    moment = utcnow() + dt.timedelta(minutes=5)

    class Waits(BaseOperator):
        def execute(self, context: Context) -> Any:
            self.defer(trigger=DateTimeTrigger(moment), method_name="done")

    operator = Waits(task_id="waits")
    with pytest.raises(TaskDeferred) as caught:
        operator.execute(None)  # type: ignore[arg-type]
    task = TaskKey(dag_id="d", task_id="waits", run_id="r")
    _, request = deferral_records(task, caught.value, defer_seq=0, resume=None)
    assert request.classpath == "airflow.triggers.temporal.DateTimeTrigger"
    wire = decode(encode(request))
    assert isinstance(wire, DeferRequest)
    assert wire.kwargs == {"moment": moment, "end_from_trigger": False}
    rebuilt = load(wire.classpath, **wire.kwargs)
    assert rebuilt.serialize() == DateTimeTrigger(moment).serialize()
