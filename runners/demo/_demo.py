"""``deferline demo``: the whole loop on the embedded broker, watched live.

Starts the embedded Tansu broker, two triggerers, a scheduler and a worker with 4 slots as
``deferline`` subprocesses; submits tasks that wait on timers, files (created by a helper
here), HTTP (a local aiohttp server), Kafka messages, deadlines that time out and triggers
that end the task themselves; shows task states live; SIGKILLs one triggerer halfway and
shows its partitions move to the other; ends with a summary. Every child runs in its own
process group and is stopped on the way out, on Ctrl-C and on errors too (and the kernel
kills it if this process dies first).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import datetime as dt
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Container, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import aiohttp
import click
from aiohttp import web
from aiokafka import TopicPartition
from deferline.client import Client
from deferline.engine import progress
from deferline.schemas import (
    DeferlineError,
    SchemaError,
    TaskStateRecord,
    TriggerEventRecord,
    decode,
)
from deferline.topics import (
    Settings,
    TansuBroker,
    TopicNames,
    TopicSpec,
    ensure_topics,
    make_consumer,
    make_producer,
    topic_specs,
)
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

__all__ = ["DemoOptions", "DemoSummary", "demo_command", "run_demo"]

EXAMPLES = "deferline.engine.examples"
RUN_MARKER_ENV = "DEFERLINE_DEMO_RUN"
"""Set in every child's environment: names the processes of one demo run."""

_FINAL = frozenset({"success", "failed", "skipped", "removed"})
_STATE_ORDER = ("scheduled", "queued", "running", "deferred", "up_for_retry", *sorted(_FINAL))
_STATE_STYLE = {
    "scheduled": "grey62",
    "queued": "cyan",
    "running": "bold yellow",
    "deferred": "magenta",
    "up_for_retry": "yellow",
    "success": "green",
    "failed": "red",
    "skipped": "blue",
    "removed": "grey50",
}


class DemoError(DeferlineError):
    """The demo could not run to its end."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """How the demo runs.

    Attributes:
        tasks: how many tasks to submit.
        duration: triggers fire within this many seconds of submission.
        seed: seed of the task mix.
        slots: worker slots.
        deadline: the demo gives up this many seconds after it started.
        kill: SIGKILL one triggerer halfway.
        kill_scheduler: run two schedulers and SIGKILL the active one halfway too.
        live: draw the live view (else print a line every few seconds).
        session_timeout_ms: triggerers' consumer-group session timeout (failover bound).
        topic_prefix: topic prefix (default: a fresh ``demo-<hex>.``).
    """

    tasks: int = 2000
    duration: float = 40.0
    seed: int = 7
    slots: int = 4
    deadline: float = 105.0
    kill: bool = True
    kill_scheduler: bool = False
    live: bool = True
    session_timeout_ms: int = 6000
    topic_prefix: str | None = None


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task of the demo and what it waits for."""

    name: str
    kind: str
    operator: str
    op_kwargs: dict[str, Any]
    expect: str
    at: float | None = None  # when the helper makes its condition true (seconds)


# kind, share of the tasks, label
KINDS: tuple[tuple[str, float, str], ...] = (
    ("timer", 0.0, "timer (TimeDeltaTrigger)"),  # the rest
    ("multi", 0.08, "defers 3 times"),
    ("end_from_trigger", 0.10, "ends from the trigger"),
    ("start_from_trigger", 0.05, "starts from the trigger"),
    ("timeout", 0.07, "times out"),
    ("file", 0.15, "file (FileTrigger)"),
    ("http", 0.15, "HTTP (HttpTrigger)"),
    ("kafka", 0.025, "Kafka message"),
)


def make_plan(
    options: DemoOptions, *, files: Path, http_base: str, signals_topic: str
) -> list[TaskSpec]:
    """The task mix, deterministic for a seed."""
    rng = random.Random(options.seed)
    n = options.tasks
    counts = {kind: int(n * share) for kind, share, _ in KINDS}
    counts["timer"] = n - sum(counts.values())
    span = max(options.duration, 4.0)

    def later(low: float = 2.0) -> float:
        return round(rng.uniform(low, span), 2)

    specs: list[TaskSpec] = []
    kwargs: dict[str, Any]
    for kind, _, _ in KINDS:
        for i in range(counts[kind]):
            name = f"{kind}-{i:04d}"
            if kind == "timer":
                spec = TaskSpec(
                    name, kind, f"{EXAMPLES}.WaitOperator", {"seconds": later()}, "success"
                )
            elif kind == "multi":
                waits = [round(rng.uniform(0.5, span / 4), 2) for _ in range(3)]
                spec = TaskSpec(
                    name, kind, f"{EXAMPLES}.MultiWaitOperator", {"waits": waits}, "success"
                )
            elif kind == "end_from_trigger":
                kwargs = {"seconds": later(), "end_from_trigger": True}
                spec = TaskSpec(name, kind, f"{EXAMPLES}.WaitOperator", kwargs, "success")
            elif kind == "start_from_trigger":
                kwargs = {"seconds": later()}
                spec = TaskSpec(
                    name, kind, f"{EXAMPLES}.StartFromTriggerWaitOperator", kwargs, "success"
                )
            elif kind == "timeout":
                kwargs = {"seconds": 3600, "timeout": round(rng.uniform(2.0, span * 0.6), 2)}
                spec = TaskSpec(name, kind, f"{EXAMPLES}.WaitOperator", kwargs, "failed")
            elif kind == "file":
                kwargs = {
                    "filepath": str(files / f"{name}.done"),
                    "deferrable": True,
                    "poke_interval": 1.0,
                }
                spec = TaskSpec(name, kind, f"{EXAMPLES}.FileSensor", kwargs, "success", later())
            elif kind == "http":
                kwargs = {
                    "url": f"{http_base}/jobs/{name}",
                    "deferrable": True,
                    "poke_interval": 1.5,
                }
                spec = TaskSpec(name, kind, f"{EXAMPLES}.HttpSensor", kwargs, "success", later())
            else:
                kwargs = {"topic": signals_topic, "match": {"job": name}}
                spec = TaskSpec(
                    name, kind, f"{EXAMPLES}.KafkaMessageOperator", kwargs, "success", later()
                )
            specs.append(spec)
    rng.shuffle(specs)
    return specs


# -- children ---------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclasses.dataclass
class Child:
    """A ``deferline`` subprocess, leader of its own process group."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    metrics_port: int | None = None
    killed_at: float | None = None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def _deferline_argv() -> list[str]:
    """How to run the ``deferline`` command: its script beside this Python, else via -c."""
    script = Path(sys.executable).with_name("deferline")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from deferline.runners.cli import main; main()"]


class Children:
    """Starts ``deferline`` subprocesses and makes sure none outlives the demo."""

    def __init__(self, env: Mapping[str, str], logdir: Path) -> None:
        self.env = dict(env)
        self.logdir = logdir
        self.children: dict[str, Child] = {}
        self._logs: list[IO[bytes]] = []

    def spawn(self, name: str, *args: str, metrics_port: int | None = None) -> Child:
        log = self.logdir / f"{name}.log"
        out = open(log, "wb")  # noqa: SIM115 - closed in stop_all
        self._logs.append(out)
        argv = [*_deferline_argv(), *args]
        proc = subprocess.Popen(
            argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        child = Child(name, proc, log, metrics_port)
        self.children[name] = child
        return child

    def sigkill(self, name: str) -> None:
        child = self.children[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.killed_at = time.monotonic()

    async def stop_all(self, grace: float = 8.0) -> None:
        """SIGTERM every process group, SIGKILL what is left after ``grace`` seconds."""
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGTERM)
        for _ in range(max(1, int(grace / 0.05))):
            if not any(c.alive for c in self.children.values()):
                break
            await asyncio.sleep(0.05)
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)
        for _ in range(100):  # reap them (SIGKILL is not ignorable: this is quick)
            if not any(c.alive for c in self.children.values()):
                break
            await asyncio.sleep(0.05)
        for out in self._logs:
            out.close()

    def crashed(self) -> list[Child]:
        return [c for c in self.children.values() if not c.alive and c.killed_at is None]


# -- helpers that make the conditions come true -------------------------------------------------


class ConditionHelpers:
    """Creates files, answers HTTP polls and publishes Kafka signals when their time comes."""

    def __init__(self, *, settings: Settings, topic: str) -> None:
        self.settings = settings
        self.topic = topic
        self.started = time.monotonic()
        self._file_due: list[tuple[float, str]] = []
        self._http_due: dict[str, float] = {}
        self._kafka_due: list[tuple[float, str]] = []
        self.http_requests = 0
        self._runner: web.AppRunner | None = None

    def plan(self, specs: Sequence[TaskSpec]) -> None:
        """The conditions to make true, and when (seconds after :meth:`run` starts)."""
        self._file_due = sorted(
            (s.at or 0.0, str(s.op_kwargs["filepath"])) for s in specs if s.kind == "file"
        )
        self._http_due = {s.name: s.at or 0.0 for s in specs if s.kind == "http"}
        self._kafka_due = sorted((s.at or 0.0, s.name) for s in specs if s.kind == "kafka")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    async def start_http(self) -> str:
        app = web.Application()
        app.router.add_get("/jobs/{name}", self._job)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def stop_http(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _job(self, request: web.Request) -> web.Response:
        self.http_requests += 1
        due = self._http_due.get(request.match_info["name"])
        if due is None:
            return web.Response(status=404, text="no such job\n")
        if self.elapsed() >= due:
            return web.json_response({"status": "done"})
        return web.Response(status=202, text="running\n")

    async def run(self, done: Container[str]) -> None:
        """Create due files and publish due Kafka signals (again until the task is done)."""
        producer = make_producer(self.settings)
        try:
            await producer.start()
            files_next = 0
            while True:
                now = self.elapsed()
                due_files = []
                while files_next < len(self._file_due) and self._file_due[files_next][0] <= now:
                    due_files.append(self._file_due[files_next][1])
                    files_next += 1
                if due_files:
                    await asyncio.to_thread(_touch_all, due_files)
                for at, name in self._kafka_due:
                    if at <= now and name not in done:
                        value = json.dumps({"job": name, "at": round(now, 2)}).encode()
                        await producer.send(self.topic, value=value, key=name.encode())
                await asyncio.sleep(1.0)
        finally:
            await producer.stop()


def _touch_all(paths: Sequence[str]) -> None:
    for path in paths:
        Path(path).write_text("done\n")


# -- watching the topics -------------------------------------------------------------------------


class Watch:
    """Folds the tasks and resume topics into what the live view and the summary show."""

    def __init__(self, specs: Sequence[TaskSpec], dag_id: str) -> None:
        self.kind_of = {f"{dag_id}/{s.name}/run/-1": s.kind for s in specs}
        self.expect = {f"{dag_id}/{s.name}/run/-1": s.expect for s in specs}
        self.state: dict[str, TaskStateRecord] = {}
        self._at: dict[str, tuple[int, int, int]] = {}
        self._running_since: dict[str, dt.datetime] = {}
        self._first: dict[str, dt.datetime] = {}
        self.slot_seconds = 0.0
        self.blocking_seconds = 0.0
        self.deferred_now = 0
        self.deferred_peak = 0
        self.events: Counter[str] = Counter()
        self.events_by_member: Counter[str] = Counter()

    def fold_task(self, record: TaskStateRecord) -> None:
        key = record.task.ti_key
        if key not in self.kind_of:
            return
        at = progress(record)
        if at <= self._at.get(key, (-1, -1, -1)):
            return
        previous = self.state.get(key)
        self._at[key] = at
        self.state[key] = record
        self._first.setdefault(key, record.updated_at)
        if previous is not None and previous.state == "deferred":
            self.deferred_now -= 1
        if record.state == "deferred":
            self.deferred_now += 1
            self.deferred_peak = max(self.deferred_peak, self.deferred_now)
        if record.state == "running":
            self._running_since[key] = record.updated_at
            self._first[key] = min(self._first[key], record.updated_at)
        elif record.source == "worker" and key in self._running_since:
            since = self._running_since.pop(key)
            self.slot_seconds += max(0.0, (record.updated_at - since).total_seconds())
        if record.state in _FINAL:
            self._running_since.pop(key, None)
            self.blocking_seconds += max(
                0.0, (record.updated_at - self._first[key]).total_seconds()
            )

    def fold_event(self, record: TriggerEventRecord) -> None:
        self.events[record.status] += 1
        if record.member is not None:
            self.events_by_member[record.member] += 1

    def by_state(self) -> Counter[str]:
        counts: Counter[str] = Counter(r.state for r in self.state.values())
        counts["scheduled"] += len(self.kind_of) - len(self.state)
        return counts

    def finished(self) -> set[str]:
        return {key for key, r in self.state.items() if r.state in _FINAL}

    def done_names(self) -> set[str]:
        return {key.split("/")[1] for key in self.finished()}

    def by_kind(self) -> dict[str, tuple[int, int]]:
        totals: Counter[str] = Counter(self.kind_of.values())
        done: Counter[str] = Counter(self.kind_of[k] for k in self.finished())
        return {kind: (done[kind], totals[kind]) for kind, _, _ in KINDS if totals[kind]}

    def unexpected(self) -> list[str]:
        return sorted(
            key
            for key, record in self.state.items()
            if record.state in _FINAL and record.state != self.expect[key]
        )


async def watch_topics(settings: Settings, watch: Watch) -> None:
    """Read the tasks and resume topics from the start into ``watch`` (runs until cancelled)."""
    names = TopicNames(settings.topic_prefix)
    consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=20)
    try:
        await consumer.start()
        tps: list[TopicPartition] = []
        for topic in (names.tasks, names.resume()):
            partitions = None
            for _ in range(100):
                partitions = consumer.partitions_for_topic(topic)
                if partitions:
                    break
                await consumer._client.force_metadata_update()
            tps += [TopicPartition(topic, p) for p in sorted(partitions or ())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while True:
            batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            for messages in batches.values():
                for message in messages:
                    if message.value is None:
                        continue
                    try:
                        record = decode(message.value)
                    except SchemaError:
                        continue
                    if isinstance(record, TaskStateRecord):
                        watch.fold_task(record)
                    elif isinstance(record, TriggerEventRecord):
                        watch.fold_event(record)
    finally:
        await consumer.stop()


# -- metrics of the children ---------------------------------------------------------------------


async def scrape(
    session: aiohttp.ClientSession, port: int | None
) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``name -> [(labels, value)]`` from a child's /metrics, or {} if it does not answer."""
    if port is None:
        return {}
    try:
        async with session.get(
            f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=1)
        ) as response:
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return {}
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return found


def _value(
    metrics: Mapping[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    return sum(
        value
        for got, value in metrics.get(name, ())
        if all(got.get(k) == v for k, v in labels.items())
    )


@dataclasses.dataclass
class Failover:
    """What happened when a triggerer was killed."""

    victim: str
    survivor: str
    killed_after: float
    partitions: list[int]
    moved_after: float | None = None


@dataclasses.dataclass
class Scrapes:
    owned: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    running: dict[str, float] = dataclasses.field(default_factory=dict)
    scheduler: dict[str, float] = dataclasses.field(default_factory=dict)
    worker: dict[str, float] = dataclasses.field(default_factory=dict)
    active_scheduler: str = "scheduler"


async def poll_children(children: Children, scrapes: Scrapes) -> None:
    async with aiohttp.ClientSession() as session:
        while True:
            for child in list(children.children.values()):
                if child.metrics_port is None:
                    continue
                got = await scrape(session, child.metrics_port) if child.alive else {}
                if child.name.startswith("triggerer"):
                    scrapes.owned[child.name] = sorted(
                        int(labels["partition"])
                        for labels, _ in got.get("deferline_triggerer_active_triggers", ())
                    )
                    scrapes.running[child.name] = _value(got, "deferline_triggers_running")
                elif child.name.startswith("scheduler") and got:
                    if _value(got, "deferline_scheduler_active") == 1:
                        scrapes.active_scheduler = child.name
                    elif scrapes.active_scheduler != child.name:
                        continue  # a standby: the active one's counters are the figures
                    scrapes.scheduler = {
                        "duplicates": _value(got, "deferline_scheduler_duplicates_dropped_total"),
                        "applied": _value(
                            got, "deferline_scheduler_events_total", verdict="applied"
                        ),
                        "resumes": _value(
                            got, "deferline_scheduler_runs_enqueued_total", mode="resume"
                        ),
                        "starts": _value(
                            got, "deferline_scheduler_runs_enqueued_total", mode="start"
                        ),
                        "resent": _value(got, "deferline_scheduler_runs_resent_total"),
                        "pending": _value(got, "deferline_scheduler_pending_events"),
                        "slots": _value(got, "deferline_scheduler_pool_slots_used"),
                    }
                elif child.name == "worker" and got:
                    scrapes.worker = {
                        "slot_seconds": _value(got, "deferline_worker_slot_seconds_total")
                        or _value(got, "deferline_worker_slot_seconds"),
                        "busy": _value(got, "deferline_worker_slots_busy"),
                        "duplicates": _value(got, "deferline_worker_duplicates_total"),
                    }
            await asyncio.sleep(0.5)


# -- the view ------------------------------------------------------------------------------------


def render(
    watch: Watch,
    scrapes: Scrapes,
    children: Children,
    failover: Failover | None,
    options: DemoOptions,
    elapsed: float,
    note: str,
) -> Group:
    total = len(watch.kind_of)
    counts = watch.by_state()
    finished = sum(counts[s] for s in _FINAL)
    header = Text.assemble(
        ("deferline demo", "bold"),
        f"  {elapsed:5.1f}s  ",
        (f"{finished}/{total} tasks finished", "bold green" if finished == total else ""),
        f"   {note}",
    )
    states = Table(title="Task states", expand=True, show_edge=False)
    states.add_column("state")
    states.add_column("tasks", justify="right")
    states.add_column("", ratio=1)
    for state in _STATE_ORDER:
        n = counts.get(state, 0)
        if n or state in ("scheduled", "running", "deferred", "success", "failed"):
            states.add_row(
                Text(state, style=_STATE_STYLE.get(state, "")),
                str(n),
                ProgressBar(
                    total=max(total, 1),
                    completed=n,
                    complete_style=_STATE_STYLE.get(state, "white"),
                ),
            )
    kinds = Table(title="By kind (finished / total)", expand=True, show_edge=False)
    kinds.add_column("kind")
    kinds.add_column("done", justify="right")
    labels = {kind: label for kind, _, label in KINDS}
    for kind, (done, all_) in watch.by_kind().items():
        kinds.add_row(labels[kind], f"{done}/{all_}")
    procs = Table(title="Processes", expand=True, show_edge=False)
    procs.add_column("process")
    procs.add_column("status")
    procs.add_column("partitions / figures")
    for child in children.children.values():
        status = (
            Text("running", style="green")
            if child.alive
            else Text("SIGKILLed" if child.killed_at else "exited", style="bold red")
        )
        if child.name.startswith("triggerer"):
            owned = scrapes.owned.get(child.name, [])
            detail = (
                f"{len(owned):2d} partitions {','.join(map(str, owned)) or '-'}; "
                f"{scrapes.running.get(child.name, 0):.0f} triggers running, "
                f"{watch.events_by_member[child.name]} events emitted"
            )
        elif child.name == "scheduler":
            s = scrapes.scheduler
            detail = (
                f"{s.get('applied', 0):.0f} events applied, "
                f"{s.get('duplicates', 0):.0f} duplicates dropped, "
                f"{s.get('resumes', 0):.0f} resumes enqueued"
            )
        else:
            w = scrapes.worker
            busy = w.get("busy", 0)
            detail = (
                f"{busy:.0f}/{options.slots} slots busy, {watch.slot_seconds:.1f} slot-seconds "
                f"used; {watch.deferred_now} tasks deferred, holding no slot"
            )
        procs.add_row(child.name, status, detail)
    parts: list[Any] = [header, states, kinds, procs]
    if failover is not None:
        lines = [
            f"t={failover.killed_after:.1f}s  SIGKILL {failover.victim} "
            f"(owned partitions {', '.join(map(str, failover.partitions)) or '-'})"
        ]
        if failover.moved_after is not None:
            lines.append(
                f"t={failover.killed_after + failover.moved_after:.1f}s  "
                f"{failover.survivor} owns them: triggers running again after "
                f"{failover.moved_after:.1f}s "
                f"(session timeout {options.session_timeout_ms / 1000:.0f}s)"
            )
        else:
            lines.append(f"waiting for the group to move them to {failover.survivor}...")
        parts.append(Panel("\n".join(lines), title="Failover", border_style="red"))
    return Group(*parts)


# -- the run -------------------------------------------------------------------------------------


@dataclasses.dataclass
class DemoSummary:
    """What the demo measured (also written as JSON with ``--summary-json``)."""

    tasks: int
    finished: int
    slots: int
    elapsed_seconds: float
    by_state: dict[str, int]
    by_kind: dict[str, list[int]]
    unexpected: list[str]
    duplicates_dropped: float
    worker_duplicate_runs: float
    runs_resent: float
    """RunTasks the scheduler sent again after a takeover without transactions."""
    events_applied: float
    events_by_status: dict[str, int]
    worker_slot_seconds: float
    blocking_slot_seconds: float
    deferred_peak: int
    failover: dict[str, Any] | None
    crashed: list[str]
    logs: str | None
    ok: bool


def _start_processes(children: Children, options: DemoOptions) -> None:
    """Two triggerers, a scheduler and a worker, each serving metrics on a local port."""
    for name in ("triggerer-a", "triggerer-b"):
        port = free_port()
        children.spawn(
            name,
            "triggerer",
            *("--member", name, "--metrics-port", str(port), "--metrics-host", "127.0.0.1"),
            *("--no-checkpoint", "--session-timeout-ms", str(options.session_timeout_ms)),
            *("--heartbeat-interval-ms", "500", "--log-level", "WARNING"),
            metrics_port=port,
        )
    for name in ("scheduler", "scheduler-b") if options.kill_scheduler else ("scheduler",):
        port = free_port()
        children.spawn(
            name,
            "scheduler",
            *("--default-pool-slots", "unlimited", "--log-level", "WARNING"),
            *("--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--lease-timeout", "6"),
            metrics_port=port,
        )
    port = free_port()
    children.spawn(
        "worker",
        "worker",
        *("--slots", str(options.slots)),
        *("--metrics-port", str(port), "--metrics-host", "127.0.0.1"),
        metrics_port=port,
    )


async def run_demo(options: DemoOptions, console: Console) -> DemoSummary:
    """Run the demo end to end; always leaves no child process behind."""
    prefix = options.topic_prefix or f"demo-{uuid.uuid4().hex[:8]}."
    workdir = Path(tempfile.mkdtemp(prefix="deferline-demo-"))
    files = workdir / "files"
    files.mkdir()
    began = time.monotonic()
    os.environ.setdefault(RUN_MARKER_ENV, prefix)
    keep_logs = False
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(lambda: None if keep_logs else shutil.rmtree(workdir, ignore_errors=True))
        console.print(
            f"[bold]deferline demo[/]: {options.tasks} tasks, starting the embedded broker..."
        )
        broker = TansuBroker()
        await broker.start()
        stack.push_async_callback(broker.stop)
        settings = Settings(bootstrap_servers=broker.bootstrap, topic_prefix=prefix, partitions=12)
        signals = f"{prefix}signals"
        await ensure_topics(settings, [*topic_specs(settings), TopicSpec(signals, 1, 1)])
        env = {
            **os.environ,
            "DEFERLINE_BOOTSTRAP_SERVERS": broker.bootstrap,
            "DEFERLINE_TOPIC_PREFIX": prefix,
            "DEFERLINE_PARTITIONS": "12",
            RUN_MARKER_ENV: prefix,
            "PYTHONUNBUFFERED": "1",
        }
        children = Children(env, workdir)
        stack.push_async_callback(children.stop_all)
        _start_processes(children, options)

        helpers = ConditionHelpers(settings=settings, topic=signals)
        http_base = await helpers.start_http()
        stack.push_async_callback(helpers.stop_http)
        specs = make_plan(options, files=files, http_base=http_base, signals_topic=signals)
        helpers.plan(specs)

        watch = Watch(specs, dag_id="demo")
        scrapes = Scrapes()
        failover: Failover | None = None
        background = await stack.enter_async_context(_Background())
        background.spawn(watch_topics(settings, watch))
        background.spawn(poll_children(children, scrapes))

        async with Client(settings) as client:
            first, *rest = specs
            await _submit(client, first)
            for chunk in _chunks(rest, 200):
                await asyncio.gather(*(_submit(client, spec) for spec in chunk))
        helpers.started = time.monotonic()
        background.spawn(helpers.run(_DoneView(watch)))

        total = len(specs)
        deadline = began + options.deadline
        view = (
            Live(console=console, refresh_per_second=4, transient=False) if options.live else None
        )
        last_line = 0.0
        note = "tasks submitted"
        try:
            if view is not None:
                view.start()
            while True:
                now = time.monotonic()
                finished = len(watch.finished())
                crashed = children.crashed()
                if crashed:
                    keep_logs = True
                    raise DemoError(
                        f"{', '.join(c.name for c in crashed)} exited; logs in {workdir}"
                    )
                halfway = finished >= total / 2 or now - helpers.started >= options.duration * 0.6
                victim, survivor = "triggerer-a", "triggerer-b"
                owned = list(scrapes.owned.get(victim, []))
                if options.kill and failover is None and halfway and owned:
                    children.sigkill(victim)
                    failover = Failover(victim, survivor, now - began, owned)
                    note = f"SIGKILLed {victim}"
                    if options.kill_scheduler:
                        children.sigkill(scrapes.active_scheduler)
                        note += f" and {scrapes.active_scheduler}"
                if failover is not None and failover.moved_after is None:
                    survivor_owns = set(scrapes.owned.get(failover.survivor, []))
                    if len(survivor_owns) == 12:
                        failover.moved_after = now - began - failover.killed_after
                        note = f"{failover.survivor} took over"
                elapsed = now - began
                if view is not None:
                    view.update(render(watch, scrapes, children, failover, options, elapsed, note))
                elif now - last_line >= 5.0:
                    last_line = now
                    counts = watch.by_state()
                    console.print(
                        f"{elapsed:5.1f}s  finished {finished}/{total}  "
                        + "  ".join(f"{s}={counts[s]}" for s in _STATE_ORDER if counts.get(s))
                        + (f"  [{note}]" if note else ""),
                        soft_wrap=True,
                        highlight=False,
                        markup=False,
                    )
                if finished >= total:
                    break
                if now >= deadline:
                    keep_logs = True
                    break
                await asyncio.sleep(0.25)
        finally:
            if view is not None:
                view.stop()
        # Let the last scrape of the scheduler's counters land.
        await asyncio.sleep(0.6)
        counts = watch.by_state()
        summary = DemoSummary(
            tasks=total,
            finished=len(watch.finished()),
            slots=options.slots,
            elapsed_seconds=round(time.monotonic() - began, 2),
            by_state={s: counts[s] for s in _STATE_ORDER if counts.get(s)},
            by_kind={k: list(v) for k, v in watch.by_kind().items()},
            unexpected=[k.split("/")[1] for k in watch.unexpected()],
            duplicates_dropped=scrapes.scheduler.get("duplicates", 0.0),
            worker_duplicate_runs=scrapes.worker.get("duplicates", 0.0),
            runs_resent=scrapes.scheduler.get("resent", 0.0),
            events_applied=scrapes.scheduler.get("applied", 0.0),
            events_by_status=dict(watch.events),
            worker_slot_seconds=round(watch.slot_seconds, 2),
            blocking_slot_seconds=round(watch.blocking_seconds, 2),
            deferred_peak=watch.deferred_peak,
            failover=dataclasses.asdict(failover) if failover is not None else None,
            crashed=[c.name for c in children.crashed()],
            logs=str(workdir) if keep_logs else None,
            ok=False,
        )
        summary.ok = (
            summary.finished == summary.tasks and not summary.unexpected and not summary.crashed
        )
        if not summary.ok:
            keep_logs = True
            summary.logs = str(workdir)
        console.print("stopping processes...")
    return summary


class _DoneView:
    """A live set view of finished task names for the Kafka signaller."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and f"demo/{name}/run/-1" in self.watch.finished()


class _Background:
    """Tasks that live as long as the demo; cancelled (and awaited) on the way out."""

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[Any]] = []

    async def __aenter__(self) -> _Background:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        task.add_done_callback(_raise_in_loop)
        self._tasks.append(task)


def _raise_in_loop(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        loop = task.get_loop()
        loop.call_exception_handler(
            {"message": "demo background task failed", "exception": task.exception(), "task": task}
        )


async def _submit(client: Client, spec: TaskSpec) -> None:
    await client.submit(
        spec.operator, dag_id="demo", task_id=spec.name, run_id="run", op_kwargs=spec.op_kwargs
    )


def _chunks(items: Sequence[TaskSpec], size: int) -> Iterator[Sequence[TaskSpec]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def print_summary(summary: DemoSummary, console: Console) -> None:
    table = Table(title="deferline demo: summary", show_header=False)
    table.add_column("")
    table.add_column("", justify="right")
    table.add_row(
        "tasks finished", f"{summary.finished}/{summary.tasks} in {summary.elapsed_seconds:.1f}s"
    )
    for state, n in summary.by_state.items():
        table.add_row(f"  {state}", str(n))
    table.add_row(
        "trigger events", ", ".join(f"{k} {v}" for k, v in sorted(summary.events_by_status.items()))
    )
    table.add_row("duplicate events dropped by the scheduler", f"{summary.duplicates_dropped:.0f}")
    table.add_row("peak tasks deferred at once", str(summary.deferred_peak))
    table.add_row(
        f"worker-slot-seconds used ({summary.slots} slots)", f"{summary.worker_slot_seconds:.1f}"
    )
    ratio = (
        summary.blocking_slot_seconds / summary.worker_slot_seconds
        if summary.worker_slot_seconds
        else 0.0
    )
    table.add_row(
        "slot-seconds blocking sensors would have held",
        f"{summary.blocking_slot_seconds:.1f}" + (f"  ({ratio:.0f}x)" if ratio else ""),
    )
    if summary.failover:
        f = summary.failover
        moved = f"{f['moved_after']:.1f}s" if f.get("moved_after") is not None else "not observed"
        table.add_row(
            f"failover: {f['victim']} SIGKILLed at {f['killed_after']:.1f}s",
            f"partitions {','.join(map(str, f['partitions'])) or '-'} → {f['survivor']} in {moved}",
        )
    if summary.unexpected:
        table.add_row("[red]unexpected outcomes", ", ".join(summary.unexpected[:10]))
    if summary.crashed:
        table.add_row("[red]crashed", ", ".join(summary.crashed))
    if summary.logs:
        table.add_row("process logs", summary.logs)
    console.print(table)
    console.print(
        "[bold green]demo OK[/]" if summary.ok else "[bold red]demo did not finish cleanly[/]"
    )


@click.command("demo")
@click.option("--tasks", type=click.IntRange(min=10), default=2000, show_default=True)
@click.option(
    "--duration",
    type=click.FloatRange(min=4.0),
    default=40.0,
    show_default=True,
    help="Triggers fire within this many seconds of submission.",
)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option(
    "--deadline",
    type=click.FloatRange(min=10.0),
    default=105.0,
    show_default=True,
    help="Give up (and fail) after this many seconds.",
)
@click.option("--no-kill", is_flag=True, help="Do not SIGKILL a triggerer halfway.")
@click.option(
    "--kill-scheduler", is_flag=True, help="Run two schedulers; SIGKILL the active one halfway."
)
@click.option("--plain", is_flag=True, help="Print progress lines instead of the live view.")
@click.option("--topic-prefix", default=None, help="Topic prefix [demo-<random>.].")
@click.option(
    "--summary-json",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the summary to this file as JSON.",
)
def demo_command(
    tasks: int,
    duration: float,
    seed: int,
    deadline: float,
    no_kill: bool,
    kill_scheduler: bool,
    plain: bool,
    topic_prefix: str | None,
    summary_json: Path | None,
) -> None:
    """Run the end-to-end demo on the embedded broker."""
    console = Console()
    options = DemoOptions(
        tasks=tasks,
        duration=duration,
        seed=seed,
        deadline=deadline,
        kill=not no_kill,
        kill_scheduler=kill_scheduler,
        live=not plain and console.is_terminal,
        topic_prefix=topic_prefix,
    )
    try:
        summary = asyncio.run(_main(options, console))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every process was stopped[/]")
        raise SystemExit(130) from None
    except DeferlineError as exc:
        raise click.ClickException(str(exc)) from exc
    print_summary(summary, console)
    if summary_json is not None:
        summary_json.write_text(json.dumps(dataclasses.asdict(summary), indent=2))
    if not summary.ok:
        raise SystemExit(1)


async def _main(options: DemoOptions, console: Console) -> DemoSummary:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    return await run_demo(options, console)
