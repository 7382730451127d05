"""Scheduler join/leave under load: resume latency around each change of the group.

A steady stream of timers falls due (``--rate`` per second) through one ``deferline
triggerer`` and the ``deferline scheduler`` processes. Each task is written as a worker writes
it (a "deferred" TaskStateRecord, then its DeferRequest for a DateTimeTrigger), ``--lead``
seconds before it falls due, by a feeder that keeps pace with the clock. Two schedulers start;
after a quiet stretch a third joins, later one leaves (SIGTERM), later one is SIGKILLed
(its partitions wait for its group session, ``--session-timeout``, to end).

Per task: resume latency = its due moment → the record time of its first resume RunTask (read
back read_committed). Reported: p50 / p99 / max of the tasks falling due in a quiet window
before the first change and in the ``--window`` seconds after each change, and the tasks
never resumed or resumed more than once:

    .venv/bin/python -m bench.bench_scheduler_churn --backend kafka
    .venv/bin/python -m bench.bench_scheduler_churn --backend tansu --rate 500
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer, TopicPartition
from deferline.schemas import TaskKey, encode, make_trigger_id
from deferline.topics import (
    Settings,
    TopicNames,
    ensure_topics,
    make_consumer,
    make_producer,
    stop_client,
    topic_specs,
)

from bench._figures import Figure, Sitting
from bench._harness import local_broker, quantile
from bench.bench_end_to_end import DEFERLINE, Process, deferral, wait_said

DAG = "churn"


@dataclass
class Run:
    """What one run saw: each task's due moment and first resume (epoch ms), the changes."""

    due_ms: dict[int, float] = field(default_factory=dict)
    resumed_ms: dict[int, float] = field(default_factory=dict)
    copies: int = 0
    late_fed: int = 0
    changes: list[tuple[str, float]] = field(default_factory=list)  # (what, epoch seconds)


RUN_WIDTH = 8  # run ids c00000000, c00000001, ...: fixed width, so bytes can be replaced
PLACEHOLDER_RUN = "c" + "X" * RUN_WIDTH
PLACEHOLDER_MOMENT = dt.datetime(2999, 1, 1, tzinfo=dt.UTC)


def task_key(run_id: str) -> TaskKey:
    return TaskKey(dag_id=DAG, task_id="wait", run_id=run_id)


def encoded(n: int) -> list[tuple[bytes, bytes, bytes, bytes]]:
    """Per task i: its key, its deferred state, its trigger id and its DeferRequest (due
    moment still a placeholder), encoded ahead of the run from one task's records with the
    run id and trigger id replaced as bytes, so that feeding 500 tasks a second costs the
    bench little CPU."""
    task = task_key(PLACEHOLDER_RUN)
    state, request = deferral(task, PLACEHOLDER_MOMENT)
    template = [task.ti_key.encode(), encode(state), encode(request)]
    run, placeholder_id = PLACEHOLDER_RUN.encode(), request.trigger_id.encode()
    out = []
    for i in range(n):
        run_id = f"c{i:0{RUN_WIDTH}d}"
        tid = make_trigger_id(task_key(run_id), 0).encode()
        key, state_value, request_value = (
            v.replace(run, run_id.encode()).replace(placeholder_id, tid) for v in template
        )
        out.append((key, state_value, tid, request_value))
    return out


async def feed(
    producer: AIOKafkaProducer,
    names: TopicNames,
    records: list[tuple[bytes, bytes, bytes, bytes]],
    run: Run,
    start: float,
    rate: float,
    lead: float,
) -> None:
    """Produce task i (due at ``start + i / rate``) once its due moment is ``lead`` seconds
    away, in order: the deferred state, then its DeferRequest."""
    placeholder = PLACEHOLDER_MOMENT.isoformat().encode()
    total = len(records)
    i = 0
    while i < total:
        horizon = time.time() + lead
        futures = []
        while i < total and start + i / rate <= horizon:
            due = start + i / rate
            if due - time.time() < lead / 2:
                run.late_fed += 1  # the feeder fell behind: its latency is still measured
            run.due_ms[i] = due * 1000
            moment = dt.datetime.fromtimestamp(due, dt.UTC).isoformat().encode()
            key, state, trigger_id, request = records[i]
            futures.append(await producer.send(names.tasks, state, key=key))
            request = request.replace(placeholder, moment)
            futures.append(await producer.send(names.defer(), request, key=trigger_id))
            i += 1
        await asyncio.gather(*futures)
        await asyncio.sleep(0.1)


async def read_resumes(
    settings: Settings, names: TopicNames, run: Run, stop: asyncio.Event
) -> None:
    """Record each task's first resume RunTask's record time (read_committed)."""
    consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=50)
    await consumer.start()
    try:
        tps = [TopicPartition(names.resumes(), p) for p in range(settings.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=100, max_records=10_000)
            for messages in batches.values():
                for message in messages:
                    if message.value is None:
                        continue
                    value = orjson.loads(message.value)
                    task = value["task"]
                    if value.get("mode") != "resume" or task["dag_id"] != DAG:
                        continue
                    i = int(task["run_id"][1:])  # c00000042 -> 42
                    if i in run.resumed_ms:
                        run.copies += 1
                    else:
                        run.resumed_ms[i] = float(message.timestamp)
    finally:
        await stop_client(consumer, grace=5.0, name="resume reader")


def latencies(run: Run, since: float, until: float) -> list[float]:
    """Resume latencies (s) of the tasks due in [since, until) epoch seconds, resumed ones."""
    return sorted(
        (run.resumed_ms[i] - due) / 1000
        for i, due in run.due_ms.items()
        if since * 1000 <= due < until * 1000 and i in run.resumed_ms
    )


def window_figures(run: Run, what: str, since: float, until: float) -> dict[str, Any]:
    values = latencies(run, since, until)
    due = sum(1 for d in run.due_ms.values() if since * 1000 <= d < until * 1000)
    figures: dict[str, Any] = {"window": what, "tasks": due, "resumed": len(values)}
    if values:
        figures |= {
            "p50_s": quantile(values, 0.50),
            "p99_s": quantile(values, 0.99),
            "max_s": values[-1],
        }
    return figures


async def wait_for(condition: Any, what: str, within: float) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"never: {what}")
        await asyncio.sleep(0.1)


async def run_churn(args: argparse.Namespace, bootstrap: str, workdir: Path) -> dict[str, Any]:
    settings = Settings(
        bootstrap_servers=bootstrap,
        topic_prefix=f"c{uuid.uuid4().hex[:8]}.",
        partitions=args.partitions,
    )
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    exe = args.deferline

    def scheduler(name: str) -> Process:
        return Process(
            exe, "scheduler", settings, workdir,
            "--default-pool-slots", "unlimited",
            "--session-timeout", str(args.session_timeout),
            "--state-dir", str(workdir / f"state-{settings.topic_prefix}{name}"),
            "--log-level", "INFO",
            *(["--standby"] if args.standby else []),
            name=f"scheduler-{settings.topic_prefix}{name}",
        )  # fmt: skip

    gap, window = args.gap, args.window
    span = args.quiet + 3 * gap + window + 5  # timers fall due for this long
    total = int(span * args.rate)
    records = encoded(total)  # before any process starts: not on the clock
    triggerer = Process(
        exe, "triggerer", settings, workdir, "--member", "t1",
        "--state-dir", str(workdir / f"state-{settings.topic_prefix}t1"),
        "--log-level", "INFO",
    )  # fmt: skip
    processes = {name: scheduler(name) for name in ("a", "b")}
    run = Run()
    stop = asyncio.Event()
    try:
        for process in processes.values():
            await wait_said(process, ("scheduler active", "scheduler ready"))

        def shared() -> bool:
            live = [p for p in processes.values() if p.proc.poll() is None]
            owned = [p.owned() for p in live]
            return sum(owned) == settings.partitions and all(owned)

        await wait_for(shared, "the schedulers share the partitions out", 120)
        await wait_said(triggerer, ("partitions assigned",), within=60)
        start = time.time() + args.lead
        producer = make_producer(settings, linger_ms=20)
        await producer.start()
        reader = asyncio.create_task(read_resumes(settings, names, run, stop))
        feeder = asyncio.create_task(
            feed(producer, names, records, run, start, args.rate, args.lead)
        )
        try:
            at = start + args.quiet

            async def until(moment: float) -> None:
                while time.time() < moment:
                    if feeder.done():
                        feeder.result()
                    await asyncio.sleep(min(0.1, max(0.0, moment - time.time())))

            await until(at)
            run.changes.append(("join (c)", time.time()))
            processes["c"] = scheduler("c")
            await until(at + gap)
            run.changes.append(("leave, SIGTERM (a)", time.time()))
            processes["a"].proc.terminate()
            await until(at + 2 * gap)
            run.changes.append(("SIGKILL (b)", time.time()))
            processes["b"].proc.kill()
            await feeder
            last_due = start + (total - 1) / args.rate
            within = max(0.0, last_due - time.time()) + 120
            with contextlib.suppress(RuntimeError):  # the ones never resumed are reported
                await wait_for(lambda: len(run.resumed_ms) >= total, "all resumed", within)
            await asyncio.sleep(2.0)  # late copies, if any, are read too
        finally:
            stop.set()
            await reader
            await producer.stop()
        windows = [window_figures(run, "quiet", start + args.quiet - window, start + args.quiet)]
        for what, moment in run.changes:
            windows.append(window_figures(run, what, moment, moment + window))
        return {
            "backend": args.backend,
            "rate": args.rate,
            "tasks": total,
            "resumed": len(run.resumed_ms),
            "lost": total - len(run.resumed_ms),
            "copies": run.copies,
            "late_fed": run.late_fed,
            "session_timeout_s": args.session_timeout,
            "standby": args.standby,
            "windows": windows,
            "load": os.getloadavg(),
        }
    finally:
        for process in processes.values():
            process.stop()
        triggerer.stop()


def print_report(result: dict[str, Any]) -> None:
    print(
        f"{result['backend']}: {result['rate']:.0f} timers/s, {result['tasks']:,} tasks, "
        f"resumed {result['resumed']:,}, lost {result['lost']}, RunTask copies "
        f"{result['copies']}, fed late {result['late_fed']}, session timeout "
        f"{result['session_timeout_s']} s{', --standby' if result['standby'] else ''}"
    )
    for w in result["windows"]:
        if "p99_s" not in w:
            print(f"  {w['window']:<22} {w['tasks']:>6} due, none resumed")
            continue
        print(
            f"  {w['window']:<22} {w['tasks']:>6} due, {w['resumed']:>6} resumed: "
            f"p50 {w['p50_s']:.3f} s  p99 {w['p99_s']:.3f} s  max {w['max_s']:.3f} s"
        )
    print("  load average at the end: " + " ".join(f"{x:.2f}" for x in result["load"]))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["tansu", "kafka"], default="kafka")
    parser.add_argument("--bootstrap", default=os.environ.get("DEFERLINE_BENCH_BOOTSTRAP"))
    parser.add_argument("--deferline", default=DEFERLINE, help="the executable to run")
    parser.add_argument("--rate", type=float, default=500.0, help="timers falling due per second")
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--session-timeout", type=float, default=6.0)
    parser.add_argument("--lead", type=float, default=10.0, help="seconds fed ahead of due")
    parser.add_argument("--quiet", type=float, default=20.0, help="seconds before the join")
    parser.add_argument("--gap", type=float, default=20.0, help="seconds between changes")
    parser.add_argument("--window", type=float, default=15.0, help="seconds after a change")
    parser.add_argument("--standby", action="store_true", help="run the schedulers with --standby")
    parser.add_argument("--keep-logs", type=Path, help="write the processes' logs here")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    sitting = Sitting.begin("scheduler_churn", broker=args.backend, deferline=args.deferline)
    async with local_broker(args.backend, args.bootstrap) as bootstrap:
        with tempfile.TemporaryDirectory(prefix="deferline-churn-") as tmp:
            workdir = args.keep_logs or Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            result = await run_churn(args, bootstrap, workdir)
    print_report(result)
    if args.json:
        print(json.dumps(result))
    sitting.write(_figures(result, args.window))


# The windows recorded: how their name starts, the claim's part, what the window follows.
CHANGES = (
    ("quiet", "quiet", "with nothing changing"),
    ("join", "join", "after a join"),
    ("leave", "leave", "after a leave (SIGTERM)"),
    ("SIGKILL", "sigkill", "after a SIGKILL"),
)


def _figures(result: dict[str, Any], seconds: float) -> list[Figure]:
    """One claim per window: its resume p99, with the run's counts in the note."""
    standby = "standby_" if result["standby"] else ""
    who = "schedulers with `--standby`" if result["standby"] else "schedulers"
    counts = (
        f"{result['tasks']:,} tasks, resumed {result['resumed']:,}, lost {result['lost']}, "
        f"RunTask copies {result['copies']}"
    )
    figures = []
    for window in result["windows"]:
        for start, part, when in CHANGES:
            if window["window"].startswith(start) and "p99_s" in window:
                figures.append(
                    Figure(
                        f"churn.{standby}{part}_resume_p99",
                        f"{who} under {result['rate']:.0f} timers/s, resume p99 "
                        + (
                            when if part == "quiet" else f"in the {seconds:g} s {when} (goal < 1 s)"
                        ),
                        round(window["p99_s"], 2),
                        "s",
                        note=counts,
                    )
                )
    return figures


if __name__ == "__main__":
    asyncio.run(main())
