"""End to end: N tasks deferred on timers due at one moment, through triggerer and scheduler.

Each task is written as a worker writes it (a "deferred" TaskStateRecord on the tasks topic,
then its DeferRequest for a DateTimeTrigger); all triggers fall due at one moment, set once
the task states are written: at least 10 s after and 1 s per 5,000 tasks, so that the
triggerer and the scheduler have read everything by then (a line says so when they were
still busy in the 2 s before). One
``deferline triggerer`` and one ``deferline scheduler`` process run on the same machine; the
triggerer's ``--capacity`` is sized for the N timers (as ``bench_triggerer``'s bursts are):
at the default (10,000, and ten times that pending) a member holds the rest of a larger burst
unread, and the figure would be its reading a slice at a time after the due moment
(docs/operations.md, "Capacity and backpressure").
Reported: due time → no task ``deferred`` on the tasks topic, the scheduler's CPU over that
span and its peak RSS, and the CPU of the triggerer and (when the bench started it) the
broker over the same span: on a small machine they share its cores. The same method as
Airflow's figure in ANCHORS.md.

``--schedulers K`` runs K scheduler processes (each owning a share of the task partitions,
waited for until the group has settled); CPU and RSS are then the sum and the largest.

``DEFERLINE_BENCH_TRIGGERER_FLAGS`` and ``DEFERLINE_BENCH_SCHEDULER_FLAGS`` add flags to the
triggerer's and the schedulers' command lines (``--capacity 10000`` for the default, say).

``--deferline`` picks the executable (another checkout's, for before/after figures):

    .venv/bin/python -m bench.bench_end_to_end --backend kafka --n 1000 10000 100000
    .venv/bin/python -m bench.bench_end_to_end --backend kafka --n 10000 --schedulers 1 2 3
    .venv/bin/python -m bench.bench_end_to_end --deferline <checkout of f32118c>/.venv/bin/deferline
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson
from aiokafka import AIOKafkaProducer, TopicPartition
from deferline.runners.triggerer import DEFAULT_CAPACITY
from deferline.schemas import (
    DeferRequest,
    ResumeTarget,
    TaskKey,
    TaskStateRecord,
    encode,
    make_trigger_id,
)
from deferline.topics import (
    Settings,
    TopicNames,
    ensure_topics,
    make_consumer,
    make_producer,
    topic_specs,
)

from bench._figures import Figure, Sitting, runs_figure, size_slug
from bench._harness import cpu_seconds, local_broker_process, peak_rss_mb

DEFERLINE = str(Path(sys.executable).with_name("deferline"))
DATETIME = "deferline.engine.triggers.DateTimeTrigger"
TARGET = ResumeTarget(operator="deferline.engine.examples.Noop")
AIRFLOW = {1_000: 7.9, 10_000: 90.3}  # ANCHORS.md: same work, same machine kind


def deferral(task: TaskKey, moment: dt.datetime) -> tuple[TaskStateRecord, DeferRequest]:
    """What a worker writes when ``task`` defers on a DateTimeTrigger due at ``moment``: its
    ``deferred`` state (to resume on the no-op operator) and its DeferRequest."""
    trigger_id = make_trigger_id(task, 0)
    state = TaskStateRecord(
        task=task,
        state="deferred",
        source="worker",
        trigger_id=trigger_id,
        next_method="execute_complete",
        resume=TARGET,
    )
    request = DeferRequest(
        trigger_id=trigger_id, task=task, classpath=DATETIME, kwargs={"moment": moment}
    )
    return state, request


class Process:
    """A deferline subprocess, its log, CPU seconds and peak RSS."""

    def __init__(
        self, exe: str, role: str, settings: Settings, workdir: Path, *flags: str, name: str = ""
    ):
        self.log = workdir / f"{name or role}.log"
        common = ["--bootstrap-servers", settings.bootstrap_servers]
        common += ["--topic-prefix", settings.topic_prefix, "--log-format", "json"]
        env = {**os.environ, "DEFERLINE_PARTITIONS": str(settings.partitions)}
        self.proc = subprocess.Popen(
            [exe, role, *common, *flags],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("wb"),
            env=env,
        )

    def said(self, message: str) -> bool:
        return bool(self.lines(message))

    def lines(self, message: str) -> list[dict[str, object]]:
        found = []
        for raw in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                line = json.loads(raw)
                if line.get("message", "").startswith(message):
                    found.append(line)
        return found

    def owned(self) -> int:
        """Partitions of its last assignment, once they are all taken over (else 0)."""
        assigned = self.lines("scheduler partitions assigned")
        if not assigned:
            return 0
        last = assigned[-1]
        taken = {
            p
            for line in self.lines("scheduler partitions acquired")
            if str(line["time"]) >= str(last["time"])
            for p in line["partitions"]  # type: ignore[attr-defined]
        }
        wanted = set(last["acquired"])  # type: ignore[call-overload]
        return len(last["partitions"]) if wanted <= taken else 0  # type: ignore[arg-type]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def wait_said(process: Process, messages: tuple[str, ...], within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not any(process.said(m) for m in messages):
        if process.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{process.log.name}: never said {messages}")
        await asyncio.sleep(0.1)


async def produce(producer: AIOKafkaProducer, records: list[tuple[str, bytes, bytes]]) -> None:
    for start in range(0, len(records), 10_000):
        futures = [
            await producer.send(topic, value, key=key)
            for topic, key, value in records[start : start + 10_000]
        ]
        await asyncio.gather(*futures)


async def run_one(
    exe: str, bootstrap: str, n: int, workdir: Path, schedulers: int = 1, broker: int | None = None
) -> dict[str, float]:
    """One run; ``broker``: the broker's process id, when the bench started it (its CPU is
    then reported too)."""
    settings = Settings(
        bootstrap_servers=bootstrap, topic_prefix=f"e{uuid.uuid4().hex[:8]}.", partitions=12
    )
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    triggerer = Process(
        exe, "triggerer", settings, workdir, "--member", "t1", "--state-dir",
        str(workdir / f"state-{settings.topic_prefix}"), "--log-level", "WARNING",
        "--capacity", str(max(DEFAULT_CAPACITY, n + 10)),
        *os.environ.get("DEFERLINE_BENCH_TRIGGERER_FLAGS", "").split(),
    )  # fmt: skip
    processes = [
        Process(
            exe,
            "scheduler",
            settings,
            workdir,
            "--default-pool-slots",
            "unlimited",
            *os.environ.get("DEFERLINE_BENCH_SCHEDULER_FLAGS", "").split(),
            name=f"scheduler-{settings.topic_prefix}{k}",
        )
        for k in range(schedulers)
    ]
    try:
        for process in processes:
            await wait_said(process, ("scheduler active", "scheduler ready"))
        deadline = time.monotonic() + 120
        while schedulers > 1 and (
            sum(p.owned() for p in processes) != settings.partitions
            or not all(p.owned() for p in processes)
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the schedulers never shared the partitions out")
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # the triggerer joins its group meanwhile
        # Records are encoded first, the DeferRequests with a placeholder due time. The task
        # states go out first; the due time is then set from how long they took (a loaded
        # machine produces slower), and the DeferRequests follow.
        placeholder = dt.datetime(2999, 1, 1, tzinfo=dt.UTC)
        states: list[tuple[str, bytes, bytes]] = []
        requests: list[tuple[str, bytes, bytes]] = []
        for i in range(n):
            task = TaskKey(dag_id="e2e", task_id="wait", run_id=f"r{i}")
            state, request = deferral(task, placeholder)
            states.append((names.tasks, task.ti_key.encode(), encode(state)))
            requests.append((names.defer(), request.trigger_id.encode(), encode(request)))
        producer = make_producer(settings, linger_ms=20, max_batch_size=1 << 20)
        await producer.start()
        try:
            began = time.monotonic()
            await produce(producer, states)
            # Long enough for the triggerer to read every request and the scheduler every
            # state before the due moment (about 20,000/s each when they share two cores):
            # the figure is the firing and the resume, not the ingest.
            margin = max(10.0, 8 * (time.monotonic() - began), n / 5000)
            due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=margin)
            print(f"  n={n:,}: due at {due:%H:%M:%S} UTC, in {margin:.0f} s", flush=True)
            stamp = placeholder.isoformat().encode(), due.isoformat().encode()
            await produce(producer, [(t, k, v.replace(*stamp)) for t, k, v in requests])
        finally:
            await producer.stop()
        if dt.datetime.now(dt.UTC) >= due:
            raise RuntimeError("producing took longer than the margin before the due time")
        deferred: set[bytes] = set()
        seen = 0
        consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=50)
        await consumer.start()
        tps = [TopicPartition(names.tasks, p) for p in range(settings.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        cpu_at_due: float | None = None
        settling: tuple[float, float] | None = None  # the processes' CPU and time, 2 s ahead
        busy_before_due = 0.0
        others_at_due = (0.0, 0.0)  # the triggerer's and the broker's CPU
        last_state_ms = 0
        last_event = dt.datetime.min.replace(tzinfo=dt.UTC)
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=100, max_records=50_000)
                for messages in batches.values():
                    for message in messages:
                        if message.key is None or message.value is None:
                            continue
                        if b'"state":"deferred"' in message.value:
                            if message.key not in deferred:
                                seen += 1
                            deferred.add(message.key)
                        else:
                            deferred.discard(message.key)
                            last_state_ms = max(last_state_ms, message.timestamp)
                            # A resumed state's updated_at is its event's emitted_at.
                            emitted = orjson.loads(message.value)["updated_at"]
                            last_event = max(last_event, dt.datetime.fromisoformat(emitted))
                now = dt.datetime.now(dt.UTC)
                if settling is None and (due - now).total_seconds() <= 2.0:
                    settling = _ours_cpu(triggerer, processes), time.monotonic()
                if cpu_at_due is None and now >= due:
                    cpu_at_due = sum(cpu_seconds(p.proc.pid) for p in processes)
                    others_at_due = _others_cpu(triggerer, broker)
                    if settling is not None:
                        spent, since = _ours_cpu(triggerer, processes) - settling[0], settling[1]
                        busy_before_due = spent / max(time.monotonic() - since, 0.1)
                if seen >= n and not deferred and cpu_at_due is not None:
                    elapsed = (now - due).total_seconds()
                    break
                if (now - due).total_seconds() > 600:
                    raise RuntimeError(f"{len(deferred)} still deferred after 600 s")
        finally:
            await consumer.stop()
        others = _others_cpu(triggerer, broker)
        due_ms = due.timestamp() * 1000
        return {
            "n": n,
            "due_to_none_deferred_s": elapsed,
            "due_to_last_event_s": (last_event - due).total_seconds(),
            "due_to_last_state_s": (last_state_ms - due_ms) / 1000,
            "scheduler_cpu_s": sum(cpu_seconds(p.proc.pid) for p in processes) - cpu_at_due,
            "scheduler_peak_rss_mb": max(peak_rss_mb(p.proc.pid) for p in processes),
            "triggerer_cpu_s": others[0] - others_at_due[0],
            "broker_cpu_s": others[1] - others_at_due[1] if broker is not None else float("nan"),
            "busy_before_due": busy_before_due,
        }
    finally:
        for process in processes:
            process.stop()
        triggerer.stop()


def _ours_cpu(triggerer: Process, schedulers: list[Process]) -> float:
    """CPU seconds so far of the triggerer and the schedulers together."""
    return sum(cpu_seconds(p.proc.pid) for p in (triggerer, *schedulers))


def _others_cpu(triggerer: Process, broker: int | None) -> tuple[float, float]:
    """CPU seconds so far of the triggerer and of the broker (0 when not ours)."""
    return cpu_seconds(triggerer.proc.pid), cpu_seconds(broker) if broker is not None else 0.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["tansu", "kafka"], default="kafka")
    parser.add_argument("--bootstrap", default=os.environ.get("DEFERLINE_BENCH_BOOTSTRAP"))
    parser.add_argument("--deferline", default=DEFERLINE, help="the executable to run")
    parser.add_argument("--n", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--keep-logs", type=Path, help="write the processes' logs here")
    parser.add_argument(
        "--schedulers", type=int, nargs="+", default=[1], help="scheduler processes (each K)"
    )
    args = parser.parse_args()
    sitting = Sitting.begin("end_to_end", broker=args.backend, deferline=args.deferline)
    runs: dict[tuple[int, int], list[dict[str, float]]] = {}
    async with local_broker_process(args.backend, args.bootstrap) as (bootstrap, broker):
        with tempfile.TemporaryDirectory(prefix="deferline-e2e-") as tmp:
            workdir = args.keep_logs or Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            for n in args.n:
                for k in args.schedulers:
                    result = await run_one(args.deferline, bootstrap, n, workdir, k, broker)
                    runs.setdefault((n, k), []).append(result)
                    airflow = AIRFLOW.get(n)
                    vs = f" (Airflow: {airflow} s)" if airflow else ""
                    print(
                        f"{args.backend} n={n:,} schedulers={k}: due → none deferred "
                        f"{result['due_to_none_deferred_s']:.2f} s{vs}, scheduler CPU "
                        f"{result['scheduler_cpu_s']:.1f} s, peak RSS "
                        f"{result['scheduler_peak_rss_mb']:.0f} MB; by record time: last event "
                        f"+{result['due_to_last_event_s']:.2f} s, last resumed state "
                        f"+{result['due_to_last_state_s']:.2f} s; CPU from the due moment to "
                        f"the end: triggerer {result['triggerer_cpu_s']:.1f} s, broker "
                        f"{result['broker_cpu_s']:.1f} s",
                        flush=True,
                    )
                    if result["busy_before_due"] > 0.25:
                        print(
                            f"  (triggerer and schedulers used {result['busy_before_due']:.0%} "
                            "of a core in the 2 s before the due moment: still reading, so "
                            "the figure includes some of the ingest)",
                            flush=True,
                        )
    sitting.write(_figures(runs))


def _figures(runs: dict[tuple[int, int], list[dict[str, float]]]) -> list[Figure]:
    """One claim per N and scheduler count: the median of its runs, each run in the note."""

    def span(key: str, results: list[dict[str, float]], unit: str) -> str:
        values = [r[key] for r in results if r[key] == r[key]]  # NaN: not measured
        if not values:
            return "not measured"
        low, high = f"{min(values):.1f}", f"{max(values):.1f}"
        return f"{low} {unit}" if low == high else f"{low} to {high} {unit}"

    figures = []
    for (n, k), results in runs.items():
        airflow = AIRFLOW.get(n)
        processes = "one scheduler" if k == 1 else f"{k} schedulers"
        figure = runs_figure(
            f"e2e.due_at_once_{size_slug(n)}" + ("" if k == 1 else f"_{k}_schedulers"),
            f"{n:,} tasks deferred on timers due at once, one triggerer and {processes}: due → "
            "no task `deferred`",
            [round(r["due_to_none_deferred_s"], 2) for r in results],
            "s",
            note=f"CPU from the due moment: scheduler {span('scheduler_cpu_s', results, 's')}, "
            f"triggerer {span('triggerer_cpu_s', results, 's')}, broker "
            f"{span('broker_cpu_s', results, 's')}; scheduler peak RSS "
            f"{span('scheduler_peak_rss_mb', results, 'MB')}"
            + (f"; Airflow: {airflow} s, anchors, an earlier sitting" if airflow else ""),
        )
        figures.append(figure)
    return figures


if __name__ == "__main__":
    asyncio.run(main())
