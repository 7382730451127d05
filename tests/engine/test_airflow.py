"""Airflow's own trigger classes under deferline's loader and adapter (needs an Airflow extra).

Runs on whichever Airflow line is installed (``make test`` runs it on 3.x and on 2.10). Tests
that must see a clean interpreter (what gets imported, what gets written) run in a
subprocess; the others import Airflow here, as a library, the way the loader does.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import importlib.util
import json
import os
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
    TimerSpec,
    TriggerEvent,
    TriggerNotAllowed,
    TriggerSupervisor,
    deferral_records,
    load_trigger,
    preload_airflow,
    redact_secrets,
    watch_assets,
)
from deferline.engine.testing import to_deferline_event
from deferline.schemas import (
    DeferRequest,
    TaskKey,
    decode,
    dumps_value,
    encode,
    loads_value,
    utcnow,
)

from tests.airflow_line import STANDARD_TRIGGERS, airflow_line

pytestmark = [pytest.mark.airflow, pytest.mark.timeout(60)]

USER_TRIGGERS = "tests.integration._airflow_ops"
AIRFLOW_PREFIXES = [STANDARD_TRIGGERS, "airflow.providers.http.triggers", USER_TRIGGERS]
DATETIME = f"{STANDARD_TRIGGERS}.temporal.DateTimeTrigger"


def run_python(code: str, tmp_path: Path, *args: str, **env: str) -> dict[str, Any]:
    """Run ``code`` (with ``args``) in a fresh interpreter with HOME in ``tmp_path``; it prints
    one JSON line last, and everything it logs goes to stderr."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))} | {
        "HOME": str(home),
        **env,
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    *logged, last = done.stdout.strip().splitlines()
    assert not logged, f"printed to stdout besides its result: {logged}"
    result: dict[str, Any] = json.loads(last)
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
    """Airflow loads as a library: root logging handlers kept (a trigger's ``self.log`` goes
    through them, on Airflow 3 too, where it is a structlog logger), nothing written under
    HOME, no ORM engine; its session factory is deferline's guard, and on Airflow 3 what a
    trigger asks its supervisor process goes to deferline's stand-in."""
    result = run_python(
        """
        import json, logging, os, sys
        handler = logging.StreamHandler(sys.stderr)
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        seen = []
        handler.emit = lambda record: seen.append([record.name, record.getMessage()])
        from deferline.engine import load_trigger, preload_airflow
        from deferline.schemas import utcnow
        assert preload_airflow(["deferline.engine.triggers", "airflow."])
        assert "airflow.models.dag" in sys.modules
        trigger = load_trigger(sys.argv[1], {"moment": utcnow()}, allowed_prefixes=["airflow"])
        trigger.log.info("logged by the trigger")
        import airflow.settings
        try:  # Airflow 3: what its triggers ask their supervisor process goes to a stand-in
            from airflow.sdk.execution_time import task_runner
            comms = type(task_runner.SUPERVISOR_COMMS).__name__
        except ImportError:
            comms = None
        files = [str(p) for p in __import__("pathlib").Path(os.environ["HOME"]).rglob("*")]
        print(json.dumps({
            "handlers_kept": logging.getLogger().handlers == [handler],
            "files_in_home": files,
            "engine": repr(airflow.settings.engine),
            "session": airflow.settings.Session.__name__,
            "comms": comms,
            "classpath": trigger.serialize()[0],
            "logged": [line for line in seen if line[1] == "logged by the trigger"],
        }))
        """,
        tmp_path,
        DATETIME,
    )
    assert result == {
        "handlers_kept": True,
        "files_in_home": [],
        "engine": "None",
        "session": "_NoDatabaseSession",
        "comms": "_SupervisorStandIn" if airflow_line() >= 3 else None,
        "classpath": DATETIME,
        "logged": [[DATETIME, "logged by the trigger"]],
    }


@pytest.fixture(scope="module")
def ops() -> Any:
    """Airflow loaded the way a triggerer loads it (as a library, no database), and this
    line's trigger classes (``tests.integration._airflow_ops`` imports them)."""
    assert preload_airflow(AIRFLOW_PREFIXES)
    return importlib.import_module(USER_TRIGGERS)


def test_events_map_onto_deferline_events(ops: Any) -> None:
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


async def collect(trigger: Any) -> list[Any]:
    """Every event of ``trigger.run()`` (a deferline or an Airflow trigger), cleanup after."""
    events = []
    try:
        async for event in trigger.run():
            events.append(event)
    finally:
        await trigger.cleanup()
    return events


def load(classpath: str, **kwargs: Any) -> BaseTrigger:
    return load_trigger(classpath, kwargs, allowed_prefixes=AIRFLOW_PREFIXES)


async def through_supervisor(trigger: BaseTrigger) -> tuple[int, list[TriggerEvent]]:
    """Run ``trigger`` in a supervisor: (timers it held while waiting, the events it fired)."""
    fired: list[TriggerEvent] = []
    done = asyncio.Event()

    def on_event(outcome: Any) -> None:
        assert outcome.status == "fired", outcome
        end = {"success": TaskSuccessEvent}.get(outcome.task_outcome)
        fired.append(TriggerEvent(outcome.payload) if end is None else end(xcoms=outcome.xcoms))
        done.set()

    async with TriggerSupervisor(capacity=10, on_event=on_event) as supervisor:
        supervisor.add("t1", trigger)
        timers = supervisor.waiting_timers
        await asyncio.wait_for(done.wait(), 10)
    return timers, fired


@pytest.mark.parametrize("end_from_trigger", [False, True])
async def test_datetime_trigger_fires_from_the_timer_heap_with_airflows_payload(
    ops: Any, end_from_trigger: bool
) -> None:
    moment = utcnow() + dt.timedelta(seconds=0.2)
    trigger = load(DATETIME, moment=moment, end_from_trigger=end_from_trigger)
    assert trigger.serialize() == (
        DATETIME,
        {"moment": moment, "end_from_trigger": end_from_trigger},
    )
    # What Airflow's own class yields, run by itself.
    [direct] = await collect(ops.DateTimeTrigger(moment, end_from_trigger=end_from_trigger))
    expected = to_deferline_event(direct)
    spec = trigger.as_timer()
    assert spec == TimerSpec(moment, expected)
    # Airflow's payload is a pendulum DateTime; the timer's, the same instant as a datetime:
    # the same tagged JSON on the wire, the same event id.
    assert dumps_value(spec.event.payload) == dumps_value(expected.payload)
    assert spec.event.event_id("t1") == expected.event_id("t1")
    assert await through_supervisor(trigger) == (1, [expected])
    # Its run() (what a supervisor calls when it does not take the timer) yields the same.
    assert await collect(load(DATETIME, moment=moment, end_from_trigger=end_from_trigger)) == [
        expected
    ]


async def test_time_delta_trigger_is_a_timer_serialized_as_a_datetime_trigger(ops: Any) -> None:
    airflow_trigger = ops.TimeDeltaTrigger(dt.timedelta(seconds=0.1))
    classpath, kwargs = airflow_trigger.serialize()
    assert classpath == DATETIME
    [direct] = await collect(ops.TimeDeltaTrigger(dt.timedelta(seconds=0.1)))
    rebuilt = load(classpath, **loads_value(dumps_value(kwargs)))
    assert await through_supervisor(rebuilt) == (1, [TriggerEvent(kwargs["moment"])])
    assert type(direct.payload) is type(kwargs["moment"])
    # Loaded by its own classpath it is a timer too (it keeps DateTimeTrigger's run()).
    by_name = load(f"{STANDARD_TRIGGERS}.temporal.TimeDeltaTrigger", delta=dt.timedelta(0))
    assert by_name.as_timer() is not None


async def test_a_datetime_trigger_subclass_with_its_own_run_is_not_a_timer(ops: Any) -> None:
    assert load(f"{USER_TRIGGERS}.LateDateTimeTrigger", moment=utcnow()).as_timer() is None
    trigger = load(f"{USER_TRIGGERS}.LateDateTimeTrigger", moment=utcnow())
    assert await through_supervisor(trigger) == (0, [TriggerEvent("late")])
    assert load(f"{USER_TRIGGERS}.GreetingTrigger", key="k").as_timer() is None


async def test_file_trigger_fires_true_once_the_file_exists(ops: Any, tmp_path: Path) -> None:
    target = tmp_path / "ready.csv"
    pattern = str(tmp_path / "*.csv")
    trigger = load(f"{STANDARD_TRIGGERS}.file.FileTrigger", filepath=pattern, poke_interval=0.05)
    run = asyncio.create_task(collect(trigger))
    await asyncio.sleep(0.2)
    assert not run.done(), "fired before the file existed"
    target.write_text("x")
    [direct] = await collect(ops.FileTrigger(pattern, poke_interval=0.05))
    assert await asyncio.wait_for(run, 10) == [TriggerEvent(direct.payload)]
    assert direct.payload is True


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
    ops: Any, http_server: tuple[str, dict[str, bool]], monkeypatch: pytest.MonkeyPatch
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
    response = ops.http_response(event.payload["response"])
    assert (response.status_code, response.json()) == (200, {"rows": 3})
    # Through deferline's codec (a header dict's keys are a str subclass) and back.
    assert loads_value(dumps_value(event.payload)) == event.payload


async def test_a_users_trigger_reads_a_variable_with_a_sync_call_in_the_loop(
    ops: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW_VAR_GREETING", "hello")
    assert await collect(load(f"{USER_TRIGGERS}.GreetingTrigger", key="greeting")) == [
        TriggerEvent({"greeting": "hello"})
    ]
    ended = load(f"{USER_TRIGGERS}.GreetingTrigger", key="greeting", end_from_trigger=True)
    assert await collect(ended) == [TaskSuccessEvent(xcoms={"greeting": "hello"})]
    # A variable set nowhere: Airflow's own "not found", at once (the stand-in never waits).
    missing = load(f"{USER_TRIGGERS}.GreetingTrigger", key="unset_anywhere")
    with pytest.raises(Exception, match="unset_anywhere") as caught:
        await asyncio.wait_for(collect(missing), 5)
    assert not isinstance(caught.value, AirflowDatabaseUnavailable)


def test_variables_and_connections_come_from_a_configured_secrets_backend(
    tmp_path: Path,
) -> None:
    """Airflow's own lookup reads the secrets backend its configuration names."""
    secrets = tmp_path / "variables.json"
    secrets.write_text(json.dumps({"greeting": "from the backend"}))
    connections = tmp_path / "connections.json"
    connections.write_text(json.dumps({"api": "http://backend.example:8080"}))
    result = run_python(
        """
        import asyncio, json, sys
        from deferline.engine import load_trigger, preload_airflow
        assert preload_airflow(["airflow.", "tests.integration._airflow_ops"])
        trigger = load_trigger("tests.integration._airflow_ops.GreetingTrigger",
                               {"key": "greeting"}, allowed_prefixes=["tests"])
        async def main():
            [event] = [e async for e in trigger.run()]
            try:
                from airflow.sdk import BaseHook
                conn = await BaseHook.aget_connection("api")
            except ImportError:  # Airflow 2.10
                from airflow.hooks.base import BaseHook
                conn = BaseHook.get_connection("api")
            return {"payload": event.payload, "host": conn.host}
        print(json.dumps(asyncio.run(main())))
        """,
        tmp_path,
        AIRFLOW__SECRETS__BACKEND="airflow.secrets.local_filesystem.LocalFilesystemBackend",
        AIRFLOW__SECRETS__BACKEND_KWARGS=json.dumps(
            {"variables_file_path": str(secrets), "connections_file_path": str(connections)}
        ),
        PYTHONPATH=str(Path(__file__).parents[2]),
    )
    assert result == {"payload": {"greeting": "from the backend"}, "host": "backend.example"}


async def test_trigger_needing_the_database_fails_with_the_reason(ops: Any) -> None:
    classpath = f"{STANDARD_TRIGGERS}.external_task.WorkflowTrigger"
    trigger = load(
        classpath,
        external_dag_id="other",
        execution_dates=[utcnow()],
        external_task_ids=["t"],
        allowed_states=["success"],
        poke_interval=0.05,
    )
    with pytest.raises(AirflowDatabaseUnavailable, match="metadata database") as caught:
        await asyncio.wait_for(collect(trigger), 10)
    assert classpath in str(caught.value)
    if airflow_line() >= 3:  # the request it made of Airflow's triggerer, by name
        assert "GetTICount" in str(caught.value)
    assert caught.value.__cause__ is None


async def test_what_only_the_database_knows_fails_naming_the_request(ops: Any) -> None:
    """XCom, DAG-run state, task-instance counts, human-in-the-loop answers: at once, clearly."""
    if airflow_line() < 3:  # 2.10 reads them through a database session
        from airflow.models import XCom

        with pytest.raises(AirflowDatabaseUnavailable, match="opened a database session"):
            XCom.get_one(key="k", dag_id="d", task_id="t", run_id="r")
        return
    import uuid

    from airflow.sdk.execution_time import comms
    from airflow.sdk.execution_time.task_runner import SUPERVISOR_COMMS

    requests = [
        comms.GetXCom(key="k", dag_id="d", run_id="r", task_id="t"),
        comms.GetDagRunState(dag_id="d", run_id="r"),
        comms.GetTICount(dag_id="d", task_ids=["t"]),
        comms.GetHITLDetailResponse(ti_id=uuid.uuid4()),
        comms.PutVariable(key="k", value="v", description=None),
    ]
    for request in requests:
        name = type(request).__name__
        with pytest.raises(AirflowDatabaseUnavailable, match=f"triggerer for {name}"):
            await asyncio.wait_for(SUPERVISOR_COMMS.asend(request), 1)
        with pytest.raises(AirflowDatabaseUnavailable, match="metadata database"):
            SUPERVISOR_COMMS.send(request)  # sync, in the event loop: raises, never waits


def test_airflow_trigger_needs_an_allowed_prefix(ops: Any) -> None:
    with pytest.raises(TriggerNotAllowed, match="not under an allowed module prefix"):
        load_trigger(DATETIME, {"moment": utcnow()}, allowed_prefixes=["airflow.providers.http"])


def test_operator_defers_on_an_airflow_trigger(ops: Any) -> None:
    """``self.defer(trigger=DateTimeTrigger(...))``: Airflow's serialize() output travels."""
    DateTimeTrigger = ops.DateTimeTrigger

    moment = utcnow() + dt.timedelta(minutes=5)

    class Waits(BaseOperator):
        def execute(self, context: Context) -> Any:
            self.defer(trigger=DateTimeTrigger(moment), method_name="done")

    operator = Waits(task_id="waits")
    with pytest.raises(TaskDeferred) as caught:
        operator.execute(None)  # type: ignore[arg-type]
    task = TaskKey(dag_id="d", task_id="waits", run_id="r")
    _, request = deferral_records(task, caught.value, defer_seq=0, resume=None)
    assert request.classpath == DATETIME
    wire = decode(encode(request))
    assert isinstance(wire, DeferRequest)
    assert wire.kwargs == {"moment": moment, "end_from_trigger": False}
    rebuilt = load(wire.classpath, **wire.kwargs)
    assert rebuilt.serialize() == DateTimeTrigger(moment).serialize()


@pytest.mark.skipif(airflow_line() < 3, reason="asset watchers are Airflow 3's")
def test_a_watchers_trigger_gets_the_assets_it_watches_as_airflow_gives_them() -> None:
    """As Airflow's triggerer before ``run()``: ``asset_state_store`` over the watched assets
    (where this Airflow has one); a trigger not Airflow's is left alone."""
    trigger = load_trigger(
        f"{STANDARD_TRIGGERS}.file.FileDeleteTrigger",
        {"filepath": "/in/flag"},
        allowed_prefixes=[STANDARD_TRIGGERS],
    )
    inner: Any = trigger.airflow_trigger  # type: ignore[attr-defined]
    watch_assets(trigger, [("inbox", "file:///in")])
    if not hasattr(inner, "asset_state_store"):
        pytest.skip("this Airflow has no asset_state_store (3.3+)")
    store = inner.asset_state_store
    assert store is not None
    asset = importlib.import_module("airflow.sdk").Asset(name="inbox", uri="file:///in")
    assert store[asset] is not None  # an accessor of the watched asset, by its name
    ours = load_trigger(
        "deferline.engine.triggers.FileTrigger",
        {"filepath": "/in/flag"},
        allowed_prefixes=["deferline.engine.triggers"],
    )
    watch_assets(ours, [("inbox", "file:///in")])
    assert not hasattr(ours, "asset_state_store")


@pytest.mark.skipif(airflow_line() < 3, reason="asset watchers are Airflow 3's")
async def test_the_airflow_face_of_the_kafka_watch_runs_its_deferline_form_here() -> None:
    """``deferline.engine.triggers.airflow.KafkaWatchTrigger``: an ``AssetWatcher`` takes it;
    its row's classpath loads under the default prefix, and deferline's adapter has its
    deferline form to run (which commits no offset itself)."""
    from deferline.engine.triggers import KafkaWatchTrigger as Native
    from deferline.engine.triggers.airflow import KafkaWatchTrigger

    sdk = importlib.import_module("airflow.sdk")
    face = KafkaWatchTrigger("orders", "orders-watch", {"kind": "order"}, start="latest")
    sdk.AssetWatcher(name="orders_watcher", trigger=face)
    classpath, kwargs = face.serialize()
    assert classpath == "deferline.engine.triggers.airflow.KafkaWatchTrigger"
    assert (
        kwargs == Native("orders", "orders-watch", {"kind": "order"}, start="latest").serialize()[1]
    )
    with pytest.raises(ValueError, match="start must be"):
        KafkaWatchTrigger("orders", "g", start="middle")  # where the DAG is parsed
    loaded = load_trigger(classpath, kwargs, allowed_prefixes=["deferline.engine.triggers"])
    loaded.trigger_id = "w-1"
    native = loaded.airflow_trigger.deferline_trigger()  # type: ignore[attr-defined]
    assert isinstance(native, Native)
    assert native.trigger_id == "w-1"
    assert not native.commits_offsets, "deferline's triggerer commits them with the events"


def test_a_callback_trigger_imports_only_a_callback_under_an_allowed_prefix() -> None:
    """Airflow's CallbackTrigger imports and awaits ``callback_path``: that path must lie
    under an allowed prefix too, or whoever writes the topic could run any function."""
    callback = "airflow.triggers.callback.CallbackTrigger"
    if importlib.util.find_spec("airflow.triggers.callback") is None:
        pytest.skip("this Airflow has no deadline-alert callbacks (3.1+)")
    allowed = ["airflow.triggers.callback", "my_company.callbacks"]
    kwargs = {"callback_path": "my_company.callbacks.page", "callback_kwargs": {}}
    trigger = load_trigger(callback, kwargs, allowed_prefixes=allowed)
    assert trigger.serialize() == (callback, kwargs)
    for path in ("os.system", "my_company.callbacksX.page", None):
        with pytest.raises(TriggerNotAllowed, match="callback_path"):
            load_trigger(callback, {"callback_path": path}, allowed_prefixes=allowed)


def test_a_secret_airflows_masker_knows_is_masked_in_a_trigger_log_line() -> None:
    """What a trigger hands ``mask_secret`` (and what Airflow masks itself: a connection's
    password) is masked in the lines the triggerer ships, as in Airflow's own logs."""
    module = "airflow.sdk.log" if airflow_line() >= 3 else "airflow.utils.log.secrets_masker"
    importlib.import_module(module).mask_secret("s3cr3t-value-4711")
    assert redact_secrets("the password is s3cr3t-value-4711") == "the password is ***"
    assert redact_secrets("nothing to hide") == "nothing to hide"


async def test_event_triggers_sharing_a_stream_share_one_poll_and_each_gets_its_own_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two of Airflow's DirectoryFileDeleteTrigger on one directory (shared_stream_key,
    Airflow 3.3): one directory scan between them, each fires for its own file."""
    module = importlib.import_module(f"{STANDARD_TRIGGERS}.file")
    cls = getattr(module, "DirectoryFileDeleteTrigger", None)
    if cls is None:
        pytest.skip("this Airflow has no shared streams (3.3+)")
    opened: list[dict[str, Any]] = []
    original = cls.open_shared_stream.__func__

    async def counted(klass: type, kwargs: dict[str, Any]) -> Any:
        opened.append(kwargs)
        async for item in original(klass, kwargs):
            yield item

    monkeypatch.setattr(cls, "open_shared_stream", classmethod(counted))
    classpath = f"{STANDARD_TRIGGERS}.file.DirectoryFileDeleteTrigger"
    fired: dict[str, Any] = {}
    both = asyncio.Event()

    def on_event(outcome: Any) -> None:
        fired[outcome.trigger_id] = outcome.payload
        if len(fired) == 2:
            both.set()

    async with TriggerSupervisor(capacity=4, on_event=on_event, block_threshold=None) as sup:
        for name in ("us", "eu"):
            kwargs = {"directory": str(tmp_path), "filename": f"{name}.flag", "poke_interval": 0.05}
            trigger = load_trigger(classpath, kwargs, allowed_prefixes=[STANDARD_TRIGGERS])
            sup.add(name, trigger, max_events=None)
        for name in ("us", "eu"):
            (tmp_path / f"{name}.flag").touch()
        await asyncio.wait_for(both.wait(), 10)
    assert fired == {
        "us": {"filepath": str(tmp_path / "us.flag")},
        "eu": {"filepath": str(tmp_path / "eu.flag")},
    }
    assert len(opened) == 1, "one scan for both"
    assert not os.listdir(tmp_path)
