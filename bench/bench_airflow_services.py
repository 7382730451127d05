"""Airflow 3 triggers' runtime requests through ``deferline airflow bridge --services-port``.

One Airflow 3 database (SQLite; PostgreSQL from Debian's packages with ``--postgres``),
migrated by ``airflow db migrate``, with HTTP connections and one variable imported by
``airflow connections import`` / ``airflow variables import``. A local endpoint (a process of
its own) answers 404 to everything, so an ``HttpSensorTrigger`` keeps polling. Measured in one
run, each phase after the one before has settled:

1. **idle**: ``deferline airflow bridge --services-port`` alone; this process loads Airflow
   as a library (``preload_airflow``, no database settings) with ``use_airflow_services`` and
   asks ``task_runner.SUPERVISOR_COMMS.asend(GetConnection / GetVariable)`` one at a time:
   p50/p99 of the round trip, the bridge's CPU per request.
2. **load**: one ``deferline triggerer`` (``DEFERLINE_AIRFLOW_SERVICES`` at the bridge, no
   database settings) on the bridge's prefix; N ``HttpSensorTrigger`` requests published to
   the defer topic as the bridge publishes a claimed row (``poke_interval`` 5, ``GET``, the
   connections round-robin). The start burst (each trigger's hook reads its connection once,
   at its first poke: ``HttpAsyncHook.config`` keeps it), then a window of steady polling:
   requests and lookups answered per second (the bridge's ``deferline_airflow_requests_total``
   and ``deferline_airflow_lookups_total``), the CPU of the bridge, the triggerer and the
   endpoint, the polls the endpoint saw, the triggerer's blocked-loop episodes; then the
   round trip again, measured as in 1.
2'. **control**: the same sensors on another triggerer (its own topics) without the services,
   its connections in its environment (``AIRFLOW_CONN_*``): what polling costs there, to tell
   the services' share of the triggerer's figures from the sensors' own (``--no-control``
   skips it).
2''. **in a trigger**: ``bench/_airflow_probe.py``'s ``ProbeTrigger``, published among the
   sensors, times the same requests from inside the triggerer as a user's trigger makes them
   (``await BaseHook.aget_connection``, a sync ``Variable.get`` inside ``run()``).
4. **airflow triggerer**: ``airflow triggerer`` itself on a copy of the database holding N
   deferred task instances whose trigger rows are the same ``HttpSensorTrigger``s (seeded
   through Airflow's code, ``tests/integration/_airflow_seed.py``) and the probe's: the rows
   it takes (its ``[triggerer] capacity``, 1,000 by default), the polls the endpoint sees,
   its CPU in a steady window, and the probe's round trips through its supervisor
   (``--no-airflow-triggerer`` skips it).
3. **airflow**: what Airflow's own triggerer pays per request in its supervisor process
   (``TriggerRunnerSupervisor._handle_request``): in a subprocess with the database settings
   (a copy of the database), the client its ``make_client`` builds on
   ``in_process_api_server()``, and N sequential ``request_handlers.handle_get_connection`` /
   ``handle_get_variable`` calls timed (wall and CPU). Its one thread answers at most
   1 / (CPU per request) requests a second.

A benchmark runs alone: before it starts, it waits (polling every 30 s, up to 20 minutes)
while a pytest run is under way on the machine.

Run: .venv/bin/python -m bench.bench_airflow_services --n 10000 [--postgres] [--connections K]
     [--json results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from deferline.schemas import DeferRequest, TaskKey, encode
from deferline.topics import Settings, TopicNames, ensure_topics, make_producer, topic_specs
from deferline.topics.testing import free_port

from bench._figures import Figure, Peer, Sitting, size_slug
from bench._harness import cpu_seconds, local_broker, machine_line, produce_batched, quantile
from bench.bench_airflow_bridge import Processes, _tree_cpu
from tests.integration import _airflow_seed as seeding
from tests.integration._postgres import PostgresServer, postgres_bin

BIN = Path(sys.executable).parent
HTTP_SENSOR = "airflow.providers.http.triggers.http.HttpSensorTrigger"
PROBE = "bench._airflow_probe.ProbeTrigger"
ALLOWED = "airflow.providers.http.triggers,bench._airflow_probe"
ROOT = Path(__file__).parents[1]
CONN_PREFIX = "bench_http_"
VARIABLE_KEY = "bench_greeting"
VARIABLE_VALUE = "kept in Airflow's database only"
ENDPOINT = "poll"
POKE_INTERVAL = 5.0
PARTITIONS = 12
AIRFLOW_CAPACITY = 1000
"""Airflow's ``[triggerer] capacity`` default: triggers one ``airflow triggerer`` runs."""
WAIT_ALONE_S = 20 * 60
Figures = dict[str, Any]


# -- a benchmark runs alone ---------------------------------------------------------------


def _pytest_runs() -> list[str]:
    """Command lines of the pytest processes running on the machine (not this one's)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if int(cmdline.parent.name) == os.getpid():
                continue
            args = cmdline.read_bytes().split(b"\0")
            if any(b"pytest" in arg for arg in args[:3]):
                found.append(b" ".join(args).decode(errors="replace")[:160])
    return found


def wait_until_alone(limit: float = WAIT_ALONE_S, poll: float = 30.0) -> float:
    """Wait while a pytest run is under way (every ``poll`` s, up to ``limit``); seconds waited."""
    started = time.monotonic()
    while (runs := _pytest_runs()) and time.monotonic() - started < limit:
        print(f"waiting: a pytest run is under way ({runs[0]}); load {os.getloadavg()}", flush=True)
        time.sleep(poll)
    if runs:
        print(f"still a pytest run after {limit:.0f} s: measuring anyway", flush=True)
    return time.monotonic() - started


def _note_others(figures: Figures, phase: str) -> None:
    """Record a pytest run seen at the end of ``phase`` (its figures are then suspect)."""
    runs = _pytest_runs()
    if runs:
        figures.setdefault("pytest_seen_after", {})[phase] = runs[0]
        print(f"note: a pytest run was under way by the end of {phase}: {runs[0]}", flush=True)


# -- the endpoint the sensors poll ------------------------------------------------------------


def serve_endpoint(port: int) -> None:
    """Answer 404 to every request, and the number of them so far at ``GET /hits``."""
    from aiohttp import web

    hits = 0

    async def not_yet(request: web.Request) -> web.Response:
        nonlocal hits
        if request.path == "/hits":
            return web.Response(text=str(hits))
        hits += 1
        return web.Response(status=404, text="not yet")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", not_yet)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, backlog=4096)


async def endpoint_hits(session: aiohttp.ClientSession, port: int) -> int:
    async with session.get(f"http://127.0.0.1:{port}/hits") as response:
        return int(await response.text())


# -- Airflow's database -----------------------------------------------------------------------


def _import_data(env: dict[str, str], home: Path, connections: int, endpoint_port: int) -> None:
    """The connections and the variable, as ``airflow connections / variables import``
    stores them (encrypted with the deployment's Fernet key)."""
    conns = {
        f"{CONN_PREFIX}{i}": {
            "conn_type": "http",
            "host": "127.0.0.1",
            "port": endpoint_port,
            "schema": "http",
        }
        for i in range(connections)
    }
    (home / "connections.json").write_text(json.dumps(conns))
    (home / "variables.json").write_text(json.dumps({VARIABLE_KEY: VARIABLE_VALUE}))
    airflow = str(BIN / "airflow")
    for what in ("connections", "variables"):
        done = subprocess.run(
            [airflow, what, "import", str(home / f"{what}.json")],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise RuntimeError(f"airflow {what} import failed:\n{done.stdout}{done.stderr}")


@contextlib.contextmanager
def databases(
    postgres: bool, home: Path, connections: int, endpoint_port: int
) -> Iterator[tuple[dict[str, str], dict[str, str], str]]:
    """The environments of Airflow's processes on the bridge's database and on a copy of it
    (for Airflow's own request handlers), and the database's name."""
    if not postgres:
        path = home / "airflow.db"
        env = seeding.airflow_env(home, f"sqlite:///{path}")
        seeding.migrate(env)
        _import_data(env, home, connections, endpoint_port)
        shutil.copyfile(path, home / "airflow-copy.db")
        yield env, seeding.airflow_env(home, f"sqlite:///{home / 'airflow-copy.db'}"), "SQLite"
        return
    bin_dir = postgres_bin()
    if bin_dir is None:
        sys.exit("PostgreSQL's server is not installed (Debian: apt-get install postgresql)")
    server = PostgresServer(bin_dir)
    try:
        env = seeding.airflow_env(home, server.create_database("services"))
        seeding.migrate(env)
        _import_data(env, home, connections, endpoint_port)
        copy = seeding.airflow_env(home, server.create_database("airflow_copy", "services"))
        version = server.psql("SHOW server_version")
        yield env, copy, f"PostgreSQL {version}"
    finally:
        server.close()


# -- metrics ----------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([^#\s{]+)(?:\{([^}]*)\})?\s+(\S+)$")


async def scrape(session: aiohttp.ClientSession, port: int, *names: str) -> dict[str, float]:
    """``name{labels}`` → value from a Prometheus endpoint (only ``names`` when given)."""
    query = [("name[]", name) for name in names]
    async with session.get(f"http://127.0.0.1:{port}/metrics", params=query) as response:
        text = await response.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            out[f"{match[1]}{{{match[2] or ''}}}"] = float(match[3])
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        value
        for key, value in samples.items()
        if key.split("{", 1)[0] == name and all(w in key for w in wanted)
    )


BRIDGE_METRICS = (
    "deferline_airflow_requests_total",
    "deferline_airflow_lookups_total",
    "deferline_airflow_request_seconds_sum",
    "deferline_airflow_request_seconds_count",
)
TRIGGERER_METRICS = (
    "deferline_triggers_running",
    "deferline_triggers_failed_total",
    "deferline_triggers_succeeded_total",
    "deferline_triggers_blocked_main_thread_total",
    "deferline_triggers_blocked_seconds_total",
    "deferline_triggerer_assigned_partitions",
)


class Snapshot:
    """Counters and CPU of the processes at one moment; ``since`` gives the deltas."""

    def __init__(self, at: float, bridge: dict[str, float], cpu: dict[str, float], hits: int):
        self.at, self.bridge, self.cpu, self.hits = at, bridge, cpu, hits

    def requests(self, outcome: str | None = None) -> float:
        labels = {"outcome": outcome} if outcome else {}
        return total(self.bridge, "deferline_airflow_requests_total", **labels)

    def lookups(self) -> float:
        return total(self.bridge, "deferline_airflow_lookups_total")


def deltas(before: Snapshot, after: Snapshot, *, asked: int = 0) -> Figures:
    """What the bridge answered and what each process spent between two snapshots;
    ``asked``: the requests of this process among them (the probe's)."""
    seconds = after.at - before.at
    requests = after.requests() - before.requests()
    answered = after.requests("answered") - before.requests("answered")
    lookups = after.lookups() - before.lookups()
    served_s = total(after.bridge, "deferline_airflow_request_seconds_sum") - total(
        before.bridge, "deferline_airflow_request_seconds_sum"
    )
    cpu = {name: after.cpu[name] - before.cpu.get(name, 0.0) for name in after.cpu}
    bridge_cpu = cpu.get("bridge", 0.0)
    figures: Figures = {
        "seconds": round(seconds, 2),
        "requests": int(requests),
        "answered": int(answered),
        "not_answered": int(requests - answered),
        "lookups": int(lookups),
        "requests_per_s": round(requests / seconds, 1),
        "requests_per_s_not_probe": round(max(0.0, requests - asked) / seconds, 1),
        "lookups_per_s": round(lookups / seconds, 1),
        "bridge_mean_request_ms": round(1000 * served_s / requests, 2) if requests else None,
        "cpu_s": {name: round(value, 2) for name, value in cpu.items()},
        "cpu_cores": {name: round(value / seconds, 2) for name, value in cpu.items()},
        "bridge_cpu_ms_per_request": round(1000 * bridge_cpu / requests, 2) if requests else None,
        "bridge_cpu_ms_per_lookup": round(1000 * bridge_cpu / lookups, 2) if lookups else None,
        "endpoint_polls": after.hits - before.hits,
        "endpoint_polls_per_s": round((after.hits - before.hits) / seconds, 1),
    }
    return figures


# -- the probe: this process asks as a trigger does -------------------------------------------


def load_airflow_as_library(url: str, home: Path) -> None:
    """Airflow in this process as a deferline triggerer loads it: no database, its runtime
    requests sent to ``url``."""
    for key in [k for k in os.environ if k.startswith(("AIRFLOW", "_AIRFLOW"))]:
        del os.environ[key]
    os.environ["AIRFLOW_HOME"] = str(home)
    from deferline.engine import preload_airflow, use_airflow_services

    use_airflow_services([url], timeout=30.0)
    if not preload_airflow(["airflow.providers"]):
        raise RuntimeError("Airflow did not load")


PROBE_WARM_UP = 20


async def probe(n: int, conn_id: str, warm_up: int = PROBE_WARM_UP) -> dict[str, list[float]]:
    """``n`` sequential ``GetConnection`` then ``n`` ``GetVariable`` (after ``warm_up`` each)
    through ``SUPERVISOR_COMMS.asend``: each round trip, in ms."""
    comms: Any = importlib.import_module("airflow.sdk.execution_time.comms")
    supervisor: Any = importlib.import_module("airflow.sdk.execution_time.task_runner")
    ask = supervisor.SUPERVISOR_COMMS.asend
    out: dict[str, list[float]] = {}
    for kind, request in (
        ("GetConnection", comms.GetConnection(conn_id=conn_id)),
        ("GetVariable", comms.GetVariable(key=VARIABLE_KEY)),
    ):
        for _ in range(warm_up):
            await ask(request)
        took = []
        for _ in range(n):
            started = time.perf_counter()
            answer = await ask(request)
            took.append(1000 * (time.perf_counter() - started))
        if kind == "GetConnection":
            assert answer.conn_id == conn_id, answer
        else:
            assert answer.value == VARIABLE_VALUE, answer
        out[kind] = took
    return out


def latency_figures(took: dict[str, list[float]]) -> Figures:
    figures: Figures = {}
    for kind, values in took.items():
        ordered = sorted(values)
        figures[kind] = {
            "n": len(ordered),
            "p50_ms": round(quantile(ordered, 0.5), 2),
            "p99_ms": round(quantile(ordered, 0.99), 2),
            "max_ms": round(ordered[-1], 2),
            "mean_ms": round(sum(ordered) / len(ordered), 2),
        }
    return figures


# -- Airflow's own supervisor's per-request work ----------------------------------------------


def airflow_request_cost(n: int, conn_id: str, warm_up: int = 20) -> Figures:
    """In a process with Airflow's database settings: N sequential requests answered as
    ``TriggerRunnerSupervisor._handle_request`` answers them (its ``make_client``)."""
    from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor
    from airflow.sdk.execution_time import request_handlers as handlers
    from airflow.sdk.execution_time.comms import GetConnection, GetVariable

    # make_client() reads no state of the supervisor: Airflow's own client, in-process API.
    client = TriggerRunnerSupervisor.make_client(None)
    out: Figures = {}
    for kind, handler, msg in (
        ("GetConnection", handlers.handle_get_connection, GetConnection(conn_id=conn_id)),
        ("GetVariable", handlers.handle_get_variable, GetVariable(key=VARIABLE_KEY)),
    ):
        for _ in range(warm_up):
            handler(client, msg)
        walls, cpus = [], []
        for _ in range(n):
            wall, cpu = time.perf_counter(), time.process_time()
            answer, _ = handler(client, msg)
            cpus.append(1000 * (time.process_time() - cpu))
            walls.append(1000 * (time.perf_counter() - wall))
        if kind == "GetConnection":
            assert answer.conn_id == conn_id, answer
        else:
            assert answer.value == VARIABLE_VALUE, answer
        walls.sort()
        cpu_ms = sum(cpus) / n
        out[kind] = {
            "n": n,
            "wall_p50_ms": round(quantile(walls, 0.5), 2),
            "wall_p99_ms": round(quantile(walls, 0.99), 2),
            "cpu_ms_per_request": round(cpu_ms, 2),
            "max_requests_per_s": round(1000 / cpu_ms, 1),
        }
    return out


def run_airflow_cost(env: dict[str, str], n: int, conn_id: str) -> Figures:
    output = _in_airflow(env, "--airflow-cost", str(n), "--conn-id", conn_id)
    figures: Figures = json.loads(output.strip().splitlines()[-1])
    return figures


# -- the run ----------------------------------------------------------------------------------


def sensor_kwargs(conn_id: str) -> dict[str, Any]:
    """An ``HttpSensorTrigger``'s kwargs, as ``HttpSensor(deferrable=True)`` defers with."""
    return {
        "endpoint": ENDPOINT,
        "data": None,
        "method": "GET",
        "headers": None,
        "extra_options": {},
        "http_conn_id": conn_id,
        "poke_interval": POKE_INTERVAL,
    }


def probe_kwargs(args: argparse.Namespace, conn_id: str, out: Path, delay: float) -> Figures:
    return {
        "conn_id": conn_id,
        "key": VARIABLE_KEY,
        "n": args.probe_n,
        "warm_up": PROBE_WARM_UP,
        "delay": delay,
        "out": str(out),
    }


def defer_requests(n: int, connections: int) -> list[tuple[bytes, bytes]]:
    """N ``HttpSensorTrigger`` deferrals as the bridge publishes claimed rows (its trigger id
    form, no resume target), the connections round-robin; (key, value) records."""
    created = dt.datetime.now(dt.UTC)
    micros = int(created.timestamp() * 1_000_000)
    records = []
    for i in range(n):
        request = DeferRequest(
            trigger_id=f"airflow-{i + 1}-{micros}",
            task=TaskKey(dag_id="bench_http_sensor", task_id="sense", run_id="bench", map_index=i),
            classpath=HTTP_SENSOR,
            kwargs=sensor_kwargs(f"{CONN_PREFIX}{i % connections}"),
            requested_at=created,
        )
        records.append((request.trigger_id.encode(), encode(request)))
    return records


async def _read_probe(path: Path, within: float, alive: Any) -> dict[str, list[float]]:
    """The probe trigger's round trips, once it has written them."""
    deadline = time.monotonic() + within
    while not await asyncio.to_thread(path.exists):
        alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the probe trigger wrote no {path} within {within:.0f} s")
        await asyncio.sleep(0.5)
    took: dict[str, list[float]] = json.loads(await asyncio.to_thread(path.read_text))
    return took


async def probe_in_trigger(
    rig: Rig, settings: Settings, args: argparse.Namespace, conn_id: str
) -> Figures:
    """2''. The probe trigger, published to the running triggerer beside its sensors."""
    out = rig.home / "probe-deferline.json"
    request = DeferRequest(
        trigger_id=f"probe-{os.getpid()}",
        task=TaskKey(dag_id="bench_probe", task_id="probe", run_id="bench", map_index=-1),
        classpath=PROBE,
        kwargs=probe_kwargs(args, conn_id, out, delay=0.0),
        requested_at=dt.datetime.now(dt.UTC),
    )
    producer = make_producer(settings)
    await producer.start()
    try:
        defer_topic = TopicNames(settings.topic_prefix).defer()
        await producer.send_and_wait(defer_topic, encode(request), key=request.trigger_id.encode())
    finally:
        await producer.stop()
    return latency_figures(await _read_probe(out, 600, rig.check))


def rewrite_seeded_rows(args: argparse.Namespace, conn_id: str, out: Path) -> None:
    """In a process with Airflow's settings: every seeded trigger row becomes an
    ``HttpSensorTrigger`` (connections round-robin), and the first one the probe trigger,
    its task instance first in Airflow's claim order (priority weight)."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.trigger import Trigger
    from airflow.utils.session import create_session
    from sqlalchemy import select, update

    with create_session() as session:
        ids = sorted(session.scalars(select(Trigger.id)))
        for i in range(args.connections):
            row = Trigger(classpath=HTTP_SENSOR, kwargs=sensor_kwargs(f"{CONN_PREFIX}{i}"))
            session.execute(
                update(Trigger)
                .where(Trigger.id.in_(ids[i :: args.connections]))
                .values(classpath=HTTP_SENSOR, encrypted_kwargs=row.encrypted_kwargs)
            )
        probe = Trigger(classpath=PROBE, kwargs=probe_kwargs(args, conn_id, out, delay=60.0))
        session.execute(
            update(Trigger)
            .where(Trigger.id == ids[0])
            .values(classpath=PROBE, encrypted_kwargs=probe.encrypted_kwargs)
        )
        session.execute(
            update(TaskInstance)
            .where(TaskInstance.trigger_id == ids[0])
            .values(priority_weight=10**6)
        )


def count_assigned() -> int:
    """In a process with Airflow's settings: trigger rows a triggerer has taken."""
    from airflow.models.trigger import Trigger
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    with create_session() as session:
        return int(session.scalar(select(func.count()).where(Trigger.triggerer_id.is_not(None))))


def _in_airflow(env: dict[str, str], *args: str) -> str:
    """This module in a process with Airflow's settings ``env``: its output."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_airflow_services", *args],
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"{args!r} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


async def airflow_triggerer(
    rig: Rig, env: dict[str, str], args: argparse.Namespace, conn_id: str
) -> Figures:
    """4. ``airflow triggerer`` on a copy of the database with N HttpSensorTrigger rows."""
    n, home = args.n, rig.home
    started = time.monotonic()
    await asyncio.to_thread(seeding.seed, env, n, dt.datetime(2100, 1, 1, tzinfo=dt.UTC))
    out = home / "probe-airflow.json"
    await asyncio.to_thread(
        _in_airflow, env, "--rewrite-rows", str(out), "--conn-id", conn_id,
        "--n", str(n), "--connections", str(args.connections),
        "--probe-n", str(args.probe_n),
    )  # fmt: skip
    print(f"airflow triggerer: {n:,} rows seeded in {time.monotonic() - started:.0f} s")
    triggerer_env = {
        **env,
        "PYTHONPATH": str(ROOT),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
    }
    rig.processes.start(
        [str(BIN / "airflow"), "triggerer"], triggerer_env, home / "airflow-triggerer.log"
    )
    proc = rig.processes.procs[-1]

    def alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"airflow triggerer exited with {proc.returncode}")

    try:
        # Its probe starts 60 s after it took the row, first: the sensors are loaded by then.
        took = await _read_probe(out, 900, alive)
        hits0, cpu0, t0 = (
            await endpoint_hits(rig.session, rig.endpoint_port),
            sum(_tree_cpu(proc.pid).values()),
            time.monotonic(),
        )
        await asyncio.sleep(args.window)
        hits1, cpu1, t1 = (
            await endpoint_hits(rig.session, rig.endpoint_port),
            sum(_tree_cpu(proc.pid).values()),
            time.monotonic(),
        )
        assigned = int(await asyncio.to_thread(_in_airflow, env, "--count-assigned"))
        alive()
    finally:
        seeding.stop_group(proc)
    seconds = t1 - t0
    polls = hits1 - hits0
    return {
        "latency": latency_figures(took),
        "rows": n,
        "rows_taken": assigned,
        "seconds": round(seconds, 1),
        "endpoint_polls_per_s": round(polls / seconds, 1),
        "cpu_cores": round((cpu1 - cpu0) / seconds, 3),
        "cpu_ms_per_poll": round(1000 * (cpu1 - cpu0) / polls, 3) if polls else None,
    }


def log_summary(path: Path) -> Figures:
    """Lines by level of a JSON log and its distinct warning/error messages (first 120 chars)."""
    levels: dict[str, int] = {}
    messages: dict[str, int] = {}
    plain = 0
    with path.open(errors="replace") as lines:
        for raw in lines:
            try:
                line = json.loads(raw)
            except ValueError:
                plain += 1
                if raw.strip():
                    messages[raw.strip()[:120]] = messages.get(raw.strip()[:120], 0) + 1
                continue
            level = str(line.get("level", line.get("levelname", "?")))
            levels[level] = levels.get(level, 0) + 1
            if level.upper() in ("WARNING", "ERROR", "CRITICAL"):
                text = str(line.get("message", ""))[:120]
                messages[text] = messages.get(text, 0) + 1
    top = sorted(messages.items(), key=lambda item: -item[1])[:8]
    return {"levels": levels, "plain_lines": plain, "messages": dict(top)}


async def _until(what: str, check: Any, within: float, every: float = 0.5) -> None:
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError, ValueError):
            if await check():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting until {what}")
        await asyncio.sleep(every)


class Rig:
    """The processes of one run (the endpoint, the bridge, a triggerer at a time) and their
    figures."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        processes: Processes,
        home: Path,
        endpoint_port: int,
        bridge_metrics: int,
    ) -> None:
        self.session, self.processes, self.home = session, processes, home
        self.endpoint_port, self.bridge_metrics = endpoint_port, bridge_metrics
        self.triggerer: subprocess.Popen[bytes] | None = None
        self.triggerer_metrics = 0

    def check(self) -> None:
        """Raise if the endpoint, the bridge or the running triggerer has exited."""
        for proc in [*self.processes.procs[:2], *([self.triggerer] if self.triggerer else [])]:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")

    def cpu(self) -> dict[str, float]:
        endpoint, bridge = self.processes.procs[0], self.processes.procs[1]
        named = {"bridge": bridge.pid, "endpoint": endpoint.pid}
        if self.triggerer is not None:
            named["triggerer"] = self.triggerer.pid
        out = {name: sum(_tree_cpu(pid).values()) for name, pid in named.items()}
        out["bench"] = cpu_seconds(os.getpid())
        return out

    async def snapshot(self) -> Snapshot:
        samples = await scrape(self.session, self.bridge_metrics, *BRIDGE_METRICS)
        hits = await endpoint_hits(self.session, self.endpoint_port)
        return Snapshot(time.monotonic(), samples, self.cpu(), hits)

    async def triggerer_state(self) -> dict[str, float]:
        return await scrape(self.session, self.triggerer_metrics, *TRIGGERER_METRICS)

    def start_triggerer(self, name: str, settings: Settings, env: dict[str, str], n: int) -> None:
        self.triggerer_metrics = free_port()
        self.processes.start(
            [
                str(BIN / "deferline"), "triggerer",
                "--bootstrap-servers", settings.bootstrap_servers,
                "--topic-prefix", settings.topic_prefix,
                "--member", name, "--state-dir", str(self.home / f"{name}-state"),
                "--capacity", str(2 * n), "--no-create-topics",
                "--metrics-port", str(self.triggerer_metrics), "--metrics-host", "127.0.0.1",
                "--log-format", "json", "--log-level", "WARNING",
            ],
            env,
            self.home / f"{name}.log",
        )  # fmt: skip
        self.triggerer = self.processes.procs[-1]

    def stop_triggerer(self) -> None:
        if self.triggerer is not None:
            seeding.stop_group(self.triggerer)
            self.triggerer = None


def triggerer_environment(home: Path, **extra: str) -> dict[str, str]:
    """A deferline triggerer's: none of Airflow's settings but an ``AIRFLOW_HOME`` of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))}
    home.mkdir()
    return env | {
        "AIRFLOW_HOME": str(home),
        "PYTHONPATH": str(ROOT),
        "DEFERLINE_ALLOWED_TRIGGER_PREFIXES": ALLOWED,
        "DEFERLINE_PARTITIONS": str(PARTITIONS),
        **extra,
    }


async def sensors(
    rig: Rig,
    name: str,
    settings: Settings,
    env: dict[str, str],
    args: argparse.Namespace,
) -> Figures:
    """Start a triggerer, publish N HttpSensorTriggers to it; the start burst, then a steady
    window of polling. The triggerer is left running."""
    n = args.n
    await ensure_topics(settings, topic_specs(settings))
    rig.start_triggerer(name, settings, env, n)

    async def assigned() -> bool:
        rig.check()
        state = await rig.triggerer_state()
        return total(state, "deferline_triggerer_assigned_partitions") >= PARTITIONS

    await _until(f"{name} owns every partition", assigned, within=300)
    records = defer_requests(n, args.connections)
    producer = make_producer(settings, linger_ms=5, max_batch_size=512 * 1024)
    await producer.start()
    try:
        start = await rig.snapshot()
        defer_topic = TopicNames(settings.topic_prefix).defer()
        await produce_batched(producer, defer_topic, records, PARTITIONS)
    finally:
        await producer.stop()
    published = time.monotonic()
    # The burst: every trigger reads its connection once, at its first poke.
    running_at: float | None = None
    last_change, last_count = published, start.requests()
    deadline = published + args.burst_limit
    while time.monotonic() < deadline:
        rig.check()
        now = time.monotonic()
        running = total(await rig.triggerer_state(), "deferline_triggers_running")
        count = total(
            await scrape(rig.session, rig.bridge_metrics, "deferline_airflow_requests_total"),
            "deferline_airflow_requests_total",
        )
        if count != last_count:
            last_change, last_count = now, count
        if running_at is None and running >= n:
            running_at = now
        if running_at is not None and now - last_change > 3.0 and now - running_at > 3.0:
            break
        await asyncio.sleep(0.1)
    end = await rig.snapshot()
    state = await rig.triggerer_state()
    burst = deltas(start, end)
    burst |= {
        "publish_s": round(published - start.at, 2),
        "publish_to_all_running_s": (
            round(running_at - published, 2) if running_at is not None else None
        ),
        "publish_to_last_request_s": round(last_change - published, 2),
        "running": int(total(state, "deferline_triggers_running")),
        "failed": int(total(state, "deferline_triggers_failed_total")),
    }
    print(f"{name} burst:", json.dumps(burst), flush=True)
    # Steady polling: the triggers poll every 5 s.
    await asyncio.sleep(args.settle)
    before, state0 = await rig.snapshot(), await rig.triggerer_state()
    await asyncio.sleep(args.window)
    after, state1 = await rig.snapshot(), await rig.triggerer_state()
    steady = deltas(before, after)
    polls = steady["endpoint_polls"]
    triggerer_cpu = steady["cpu_s"].get("triggerer", 0.0)
    steady["triggerer_cpu_ms_per_poll"] = round(1000 * triggerer_cpu / polls, 3) if polls else None
    blocked = "deferline_triggers_blocked_main_thread_total"
    blocked_s = "deferline_triggers_blocked_seconds_total"
    assert rig.triggerer is not None
    figures: Figures = {
        "burst": burst,
        "steady": steady,
        "triggerer": {
            "running": int(total(state1, "deferline_triggers_running")),
            "failed": int(total(state1, "deferline_triggers_failed_total")),
            "fired": int(total(state1, "deferline_triggers_succeeded_total")),
            "blocked_episodes_in_window": int(total(state1, blocked) - total(state0, blocked)),
            "blocked_s_in_window": round(total(state1, blocked_s) - total(state0, blocked_s), 2),
            "blocked_episodes_all": int(total(state1, blocked)),
            "blocked_s_all": round(total(state1, blocked_s), 2),
            "peak_rss_mb": round(_peak_rss(rig.triggerer.pid), 1),
        },
    }
    print(f"{name} steady:", json.dumps(figures["steady"]), flush=True)
    return figures


async def run(args: argparse.Namespace) -> Figures:
    waited = wait_until_alone() if not args.no_wait else 0.0
    version = importlib.metadata.version("apache-airflow")
    http = importlib.metadata.version("apache-airflow-providers-http")
    n, connections = args.n, args.connections
    figures: Figures = {
        "machine": machine_line(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "airflow_version": version,
        "http_provider": http,
        "n_triggers": n,
        "connections": connections,
        "probe_n": args.probe_n,
        "window_s": args.window,
        "waited_for_quiet_s": round(waited),
    }
    conn_id = f"{CONN_PREFIX}0"
    asked = 2 * (args.probe_n + PROBE_WARM_UP)
    with contextlib.ExitStack() as stack:
        home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-services-")))
        endpoint_port = free_port()
        if args.keep_logs:
            stack.callback(_keep_logs, home, args.keep_logs)
        processes = Processes()
        stack.callback(processes.stop)
        command = [sys.executable, "-m", "bench.bench_airflow_services"]
        processes.start(
            [*command, "--endpoint", str(endpoint_port)],
            {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
            home / "endpoint.log",
        )
        t0 = time.monotonic()
        env, copy_env, database = stack.enter_context(
            databases(args.postgres, home, connections, endpoint_port)
        )
        figures["database"] = database
        print(f"{database}: migrated and filled in {time.monotonic() - t0:.0f} s", flush=True)

        async with local_broker(args.backend) as bootstrap, aiohttp.ClientSession() as session:
            pid = os.getpid()
            settings = Settings(
                bootstrap_servers=bootstrap, topic_prefix=f"benchsvc{pid}.", partitions=PARTITIONS
            )
            await ensure_topics(settings, topic_specs(settings))
            services_port, bridge_metrics = free_port(), free_port()
            url = f"http://127.0.0.1:{services_port}"
            prefix = settings.topic_prefix
            processes.start(
                [
                    str(BIN / "deferline"), "airflow", "bridge",
                    "--bootstrap-servers", bootstrap, "--topic-prefix", prefix,
                    "--bridge-prefix", prefix,
                    "--services-port", str(services_port), "--services-host", "127.0.0.1",
                    "--metrics-port", str(bridge_metrics), "--metrics-host", "127.0.0.1",
                    "--log-format", "json", "--log-level", "WARNING",
                ],
                {
                    **env,
                    "DEFERLINE_ALLOWED_TRIGGER_PREFIXES": ALLOWED,
                    "DEFERLINE_PARTITIONS": str(PARTITIONS),
                    "DEFERLINE_COPY_EVENTS_TO_TASKS": "false",
                },
                home / "bridge.log",
            )  # fmt: skip
            rig = Rig(session, processes, home, endpoint_port, bridge_metrics)

            async def served() -> bool:
                processes.check()
                await scrape(session, bridge_metrics)  # labelled counters: no samples yet
                return True

            await _until("the bridge serves its metrics", served, within=300)
            # The services start after the bridge's metrics: the probe's warm-up waits for them.
            load_airflow_as_library(url, home / "probe-home")

            # 1. Idle: the bridge alone answers this process's requests one at a time.
            await probe(1, conn_id, warm_up=50)
            before = await rig.snapshot()
            took = await probe(args.probe_n, conn_id)
            after = await rig.snapshot()
            figures["idle"] = {
                "latency": latency_figures(took),
                "window": deltas(before, after, asked=asked),
            }
            print("idle:", json.dumps(figures["idle"]), flush=True)
            _note_others(figures, "idle")

            # 2. Load: a deferline triggerer asking the bridge, N HttpSensorTriggers.
            services_env = triggerer_environment(
                home / "triggerer-home", DEFERLINE_AIRFLOW_SERVICES=url
            )
            load = await sensors(rig, "triggerer", settings, services_env, args)
            # Then the probe again, the triggers polling meanwhile.
            before = await rig.snapshot()
            took = await probe(args.probe_n, conn_id)
            after = await rig.snapshot()
            load["latency"] = latency_figures(took)
            load["probe_window"] = deltas(before, after, asked=asked)
            load["in_trigger"] = await probe_in_trigger(rig, settings, args, conn_id)
            figures["load"] = load
            print("load:", json.dumps(load["probe_window"]), flush=True)
            _note_others(figures, "load")
            rig.stop_triggerer()

            # 2'. The same sensors on a triggerer without the services (the connections in
            # its environment, Airflow's AIRFLOW_CONN_*): what polling costs without them.
            if not args.no_control:
                conns = {
                    f"AIRFLOW_CONN_{CONN_PREFIX.upper()}{i}": json.dumps(
                        {"conn_type": "http", "host": "127.0.0.1", "port": endpoint_port}
                    )
                    for i in range(connections)
                }
                control_env = triggerer_environment(home / "control-home", **conns)
                control_settings = settings.model_copy(update={"topic_prefix": f"benchctl{pid}."})
                control = await sensors(rig, "control", control_settings, control_env, args)
                figures["control"] = control
                _note_others(figures, "control")
                rig.stop_triggerer()
            # 4. Airflow's own triggerer on a copy of the database, the same sensors as rows.
            if not args.no_airflow_triggerer:
                figures["airflow_triggerer"] = await airflow_triggerer(rig, copy_env, args, conn_id)
                print("airflow triggerer:", json.dumps(figures["airflow_triggerer"]), flush=True)
                _note_others(figures, "airflow_triggerer")
            processes.stop()
            figures["logs"] = {
                name: log_summary(home / f"{name}.log")
                for name in ("bridge", "triggerer", "control", "airflow-triggerer")
                if (home / f"{name}.log").exists()
            }

        # 3. Airflow's triggerer: its supervisor's work per request, on a copy of the database.
        figures["airflow_supervisor"] = run_airflow_cost(copy_env, args.probe_n, conn_id)
        print("airflow supervisor:", json.dumps(figures["airflow_supervisor"]), flush=True)
        _note_others(figures, "airflow_supervisor")
    figures["capacity"] = capacity_figures(figures)
    return figures


def _keep_logs(home: Path, to: Path) -> None:
    to.mkdir(parents=True, exist_ok=True)
    for log in home.glob("*.log"):
        shutil.copyfile(log, to / log.name)


def _peak_rss(pid: int) -> float:
    from bench._harness import peak_rss_mb

    with contextlib.suppress(OSError):
        return peak_rss_mb(pid)
    return 0.0


def capacity_figures(figures: Figures) -> Figures:
    """What Airflow's supervisor thread and the bridge serve against what N sensors need."""
    airflow_rate = figures["airflow_supervisor"]["GetConnection"]["max_requests_per_s"]
    airflow_ms = figures["airflow_supervisor"]["GetConnection"]["cpu_ms_per_request"]
    out: Figures = {}
    for sensors in sorted({AIRFLOW_CAPACITY, figures["n_triggers"]}):
        per_poke = sensors / POKE_INTERVAL
        out[str(sensors)] = {
            "needed_per_s_if_read_each_poke": per_poke,
            "airflow_supervisor_share_if_each_poke": round(per_poke / airflow_rate, 2),
            "airflow_start_lookups_s": round(sensors * airflow_ms / 1000, 1),
        }
    return out


# -- the table --------------------------------------------------------------------------------


def _ms(latency: Figures, kind: str) -> str:
    f = latency[kind]
    return f"{f['p50_ms']:.2f} / {f['p99_ms']:.2f} (max {f['max_ms']:.1f})"


def _value(value: Any, unit: str = "") -> str:
    return "n/a" if value is None else f"{value}{unit}"


def _pair(load: Figures, control: Figures | None, *path: str) -> str:
    """``services / control`` of one figure (the control's when it ran)."""

    def get(figures: Figures) -> Any:
        value: Any = figures
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return _value(get(load)) + ("" if control is None else f" / {_value(get(control))}")


def table(figures: Figures) -> str:
    idle, load, airflow = figures["idle"], figures["load"], figures["airflow_supervisor"]
    control: Figures | None = figures.get("control")
    burst, steady, probe_window = load["burst"], load["steady"], load["probe_window"]
    n, k = figures["n_triggers"], figures["connections"]
    both = " (services / control)" if control is not None else ""
    rows = [
        ("**1. idle: round trip, sequential, this process → bridge**", ""),
        ("GetConnection p50 / p99 ms", _ms(idle["latency"], "GetConnection")),
        ("GetVariable p50 / p99 ms", _ms(idle["latency"], "GetVariable")),
        ("bridge CPU ms per request", _value(idle["window"]["bridge_cpu_ms_per_request"])),
        ("bridge mean service time ms", _value(idle["window"]["bridge_mean_request_ms"])),
        (f"**2a. start burst: {n:,} HttpSensorTriggers, {k} connection(s)**", ""),
        (
            "publish → all running s" + both,
            _pair(load, control, "burst", "publish_to_all_running_s"),
        ),
        ("publish → last request answered s", _value(burst["publish_to_last_request_s"])),
        ("requests reaching the bridge / lookups", f"{burst['requests']} / {burst['lookups']}"),
        ("not answered (errors, refusals)", str(burst["not_answered"])),
        (
            "bridge CPU s (ms per request / per lookup)",
            f"{burst['cpu_s']['bridge']} ({_value(burst['bridge_cpu_ms_per_request'])} / "
            f"{_value(burst['bridge_cpu_ms_per_lookup'])})",
        ),
        ("triggerer CPU s" + both, _pair(load, control, "burst", "cpu_s", "triggerer")),
        ("triggers running / failed", f"{burst['running']} / {burst['failed']}"),
        (f"**2b. steady polling, {steady['seconds']:.0f} s window, no probe**", ""),
        (
            f"endpoint polls/s (scheduled: {n / POKE_INTERVAL:.0f})" + both,
            _pair(load, control, "steady", "endpoint_polls_per_s"),
        ),
        ("requests/s answered by the bridge", str(steady["requests_per_s"])),
        ("lookups/s", str(steady["lookups_per_s"])),
        ("triggerer CPU cores" + both, _pair(load, control, "steady", "cpu_cores", "triggerer")),
        (
            "triggerer CPU ms per poll" + both,
            _pair(load, control, "steady", "triggerer_cpu_ms_per_poll"),
        ),
        (
            "triggerer blocked-loop episodes / s blocked, in window" + both,
            _pair(load, control, "triggerer", "blocked_episodes_in_window")
            + "; "
            + _pair(load, control, "triggerer", "blocked_s_in_window"),
        ),
        ("triggerer peak RSS MB" + both, _pair(load, control, "triggerer", "peak_rss_mb")),
        ("triggers failed" + both, _pair(load, control, "triggerer", "failed")),
        (
            "CPU cores: bridge / endpoint",
            f"{steady['cpu_cores']['bridge']} / {steady['cpu_cores']['endpoint']}",
        ),
        ("**2c. round trip under load (sensors polling)**", ""),
        ("GetConnection p50 / p99 ms", _ms(load["latency"], "GetConnection")),
        ("GetVariable p50 / p99 ms", _ms(load["latency"], "GetVariable")),
        (
            "requests/s (all / not the probe's)",
            f"{probe_window['requests_per_s']} / {probe_window['requests_per_s_not_probe']}",
        ),
        (
            "bridge CPU ms per request / per lookup",
            f"{_value(probe_window['bridge_cpu_ms_per_request'])} / "
            f"{_value(probe_window['bridge_cpu_ms_per_lookup'])}",
        ),
        (
            "CPU cores: bridge / triggerer / endpoint / bench",
            " / ".join(
                str(probe_window["cpu_cores"].get(name))
                for name in ("bridge", "triggerer", "endpoint", "bench")
            ),
        ),
        ("**2d. round trip inside a trigger (probe trigger among the sensors)**", ""),
        ("GetConnection p50 / p99 ms (aget_connection)", _ms(load["in_trigger"], "GetConnection")),
        ("GetVariable p50 / p99 ms (sync Variable.get)", _ms(load["in_trigger"], "GetVariable")),
    ]
    live: Figures | None = figures.get("airflow_triggerer")
    if live is not None:
        rows += [
            (f"**airflow triggerer, {live['rows']:,} HttpSensorTrigger rows, same run**", ""),
            ("rows it took (its capacity)", f"{live['rows_taken']:,}"),
            ("GetConnection p50 / p99 ms in a trigger", _ms(live["latency"], "GetConnection")),
            ("GetVariable p50 / p99 ms in a trigger", _ms(live["latency"], "GetVariable")),
            (
                f"endpoint polls/s in a {live['seconds']:.0f} s window; CPU cores; ms per poll",
                f"{live['endpoint_polls_per_s']}; {live['cpu_cores']}; "
                f"{_value(live['cpu_ms_per_poll'])}",
            ),
        ]
    rows += [
        ("**3. Airflow's triggerer supervisor, per request (one thread)**", ""),
    ]
    for kind in ("GetConnection", "GetVariable"):
        f = airflow[kind]
        rows.append(
            (
                f"{kind}: wall p50 / p99 ms; CPU ms; max/s",
                f"{f['wall_p50_ms']} / {f['wall_p99_ms']}; {f['cpu_ms_per_request']}; "
                f"{f['max_requests_per_s']}",
            )
        )
    idle_ms = idle["window"]["bridge_cpu_ms_per_request"]
    burst_rate = (
        round(n / burst["publish_to_last_request_s"], 1)
        if burst["publish_to_last_request_s"]
        else None
    )
    rows += [
        ("**4. rates: served against needed**", ""),
        (
            "Airflow supervisor: max GetConnection/s (1 / CPU)",
            str(airflow["GetConnection"]["max_requests_per_s"]),
        ),
        (
            "bridge: max lookups/s per thread (1 / idle CPU per request)",
            _value(round(1000 / idle_ms, 1) if idle_ms else None),
        ),
        (
            "start burst: triggers served their connection/s (N / publish → last answer)",
            _value(burst_rate),
        ),
        ("steady polling: requests/s the sensors made (measured)", str(steady["requests_per_s"])),
    ]
    for sensors, c in figures["capacity"].items():
        rows.append(
            (
                f"{int(sensors):,} sensors: requests at start (Airflow supervisor CPU s)",
                f"{int(sensors):,} ({c['airflow_start_lookups_s']} s)",
            )
        )
        rows.append(
            (
                f"{int(sensors):,} sensors, if read each poke: needed/s (Airflow share)",
                f"{c['needed_per_s_if_read_each_poke']:.0f} "
                f"({c['airflow_supervisor_share_if_each_poke']:.0%} of its thread)",
            )
        )
    head = [
        f"{figures['machine']}; Airflow {figures['airflow_version']}, http provider "
        f"{figures['http_provider']}, {figures['database']}; {figures['date']}",
        *(
            [f"(a pytest run was under way after: {', '.join(figures['pytest_seen_after'])})"]
            if figures.get("pytest_seen_after")
            else []
        ),
        "",
        "| figure | value |",
        "|---|---|",
    ]
    return "\n".join(head + [f"| {name} | {value} |" for name, value in rows])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=10_000, help="HttpSensorTriggers")
    parser.add_argument("--connections", type=int, default=1, help="distinct http_conn_ids")
    parser.add_argument("--probe-n", type=int, default=500, help="sequential requests per kind")
    parser.add_argument("--window", type=float, default=30.0, help="steady window, seconds")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the burst")
    parser.add_argument("--burst-limit", type=float, default=300.0, help="seconds")
    parser.add_argument("--postgres", action="store_true", help="PostgreSQL, not SQLite")
    parser.add_argument("--backend", default="tansu", choices=("tansu", "kafka"))
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--keep-logs", type=Path, help="copy the processes' logs here")
    parser.add_argument("--no-wait", action="store_true", help="do not wait for pytest runs")
    parser.add_argument(
        "--no-control", action="store_true", help="skip the triggerer without the services"
    )
    parser.add_argument(
        "--no-airflow-triggerer", action="store_true", help="skip airflow triggerer's phase"
    )
    parser.add_argument("--endpoint", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rewrite-rows", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--count-assigned", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--airflow-cost", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--conn-id", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.endpoint is not None:
        serve_endpoint(args.endpoint)
        return
    if args.rewrite_rows is not None:
        rewrite_seeded_rows(args, args.conn_id, args.rewrite_rows)
        return
    if args.count_assigned:
        print(count_assigned())
        return
    if args.airflow_cost is not None:
        print(json.dumps(airflow_request_cost(args.airflow_cost, args.conn_id)))
        return
    sitting = Sitting.begin("airflow_services", broker=args.backend)
    figures = asyncio.run(run(args))
    print()
    print(table(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    sitting.write(_claims(figures))


def _claims(figures: Figures) -> list[Figure]:
    """The run's claims, each beside Airflow's figure from the same run where it ran."""
    idle, load, airflow = figures["idle"], figures["load"], figures["airflow_supervisor"]
    live: Figures | None = figures.get("airflow_triggerer")
    n, k = figures["n_triggers"], figures["connections"]

    def pair(latency: Figures, kind: str) -> str:
        return f"{latency[kind]['p50_ms']:.2f} / {latency[kind]['p99_ms']:.2f}"

    claims = []
    for kind, slug in (("GetConnection", "get_connection"), ("GetVariable", "get_variable")):
        supervisor = airflow[kind]
        claims += [
            Figure(
                f"services.{slug}_idle",
                f"one `{kind}`, Airflow's own code in a triggerer process → bridge → answer, "
                "sequential: p50 / p99",
                pair(idle["latency"], kind),
                "ms",
                peer=Peer(
                    "Airflow's supervisor, the same request through its in-process API, same run",
                    f"{supervisor['wall_p50_ms']} / {supervisor['wall_p99_ms']} ms wall, "
                    f"{supervisor['cpu_ms_per_request']} ms CPU",
                ),
                note=f"bridge CPU {idle['window']['bridge_cpu_ms_per_request']} ms per request",
            ),
            Figure(
                f"services.{slug}_polling",
                f"a `{kind}` from a triggerer process through the bridge while {n:,} "
                "`HttpSensorTrigger`s poll in it: p50 / p99",
                pair(load["latency"], kind),
                "ms",
            ),
        ]
        if "in_trigger" in load:
            claims.append(
                Figure(
                    f"services.trigger_{slug}",
                    f"a `{kind}` from inside a trigger, {n:,} `HttpSensorTrigger`s polling beside "
                    "it: p50 / p99",
                    pair(load["in_trigger"], kind),
                    "ms",
                    peer=None
                    if live is None
                    else Peer(
                        f"`airflow triggerer`, same run: it takes {live['rows_taken']:,} of the "
                        f"{live['rows']:,} sensors",
                        pair(live["latency"], kind) + " ms",
                    ),
                )
            )
    steady, burst = load["steady"], load["burst"]
    claims.append(
        Figure(
            f"services.sensor_polls_{size_slug(n)}",
            f"{n:,} `HttpSensorTrigger`s polling: endpoint polls/s",
            steady["endpoint_polls_per_s"],
            "polls/s",
            peer=None
            if live is None
            else Peer(
                f"`airflow triggerer`, its {live['rows_taken']:,}, same run",
                f"{live['endpoint_polls_per_s']} polls/s, "
                f"{live['cpu_ms_per_poll']} ms CPU per poll",
            ),
            note=f"triggerer CPU {steady['triggerer_cpu_ms_per_poll']} ms per poll",
        )
    )
    if k == 1:
        claims.append(
            Figure(
                f"services.shared_start_{size_slug(n)}",
                f"{n:,} `HttpSensorTrigger`s started at once on one stored connection: requests "
                "reaching the bridge",
                burst["requests"],
                "",
                note=f"publish → all running {burst['publish_to_all_running_s']} s",
            )
        )
    else:
        claims.append(
            Figure(
                f"services.distinct_connections_{size_slug(n)}",
                f"{n:,} `HttpSensorTrigger`s started at once, each on a connection of its own: "
                "publish → last answered",
                burst["publish_to_last_request_s"],
                "s",
                note=f"{burst['not_answered']} not answered, {burst['failed']} failed",
            )
        )
    return claims


if __name__ == "__main__":
    main()
