"""Scheduler figures: the pure fold, a rebuild from the tasks topic, and events applied live.

1. fold: N task instances through a whole life (scheduled → queued → running → deferred →
   fired → queued → running → success) in one TaskTable, plus one duplicate event each.
   Reported: records folded per second (tasks-topic records and events).
2. rebuild: the tasks topic holds the records of N tasks (about 4 per task); a Scheduler
   starts and folds it to the end. Reported: seconds and records per second until ready.
3. live: N deferred tasks, N events produced at once; reported: seconds until the scheduler
   published every resume, events applied per second.
4. apply: N deferred tasks (with a resume target) and their N events already on the topics;
   a scheduler starts, acquires every partition and applies them all. Reported: seconds and
   scheduler CPU (this process: nothing else runs in it meanwhile) from active until every
   decision is published and read back from the tasks topic, CPU per resumed task.
5. path: the scheduler's work per event without a broker: N events (as bytes) of N deferred
   tasks decoded, folded and their decisions (a ``queued`` state and a RunTask each) encoded,
   in batches of 10,000 as the scheduler reads them. Reported: events per second, µs each.
6. memory: bytes the fold keeps per task (tracemalloc), N tasks deferred, then resumed.
7. restart: the tasks topic holds N deferred tasks (one record each); time until a
   scheduler is ready, cold (no checkpoint: the whole topic is folded, as every start did
   before checkpoints) and from its local checkpoint with N/100 records written after it
   (restore, then fold the tail), and that restart again with standby tables (``standby``).
   Also reported: the first (full) checkpoint write and its size on disk. ``--backend
   kafka`` runs it on Apache Kafka.
8. states: the fold of a partition taken over, or of a start without a checkpoint, without a
   broker: the tasks-topic records of N tasks (as bytes: scheduled with a resume target,
   running, deferred) decoded and folded into a fresh table, then drained. Reported: records
   per second, µs of CPU each.
9. idle: a ``deferline scheduler`` process (``--deferline``) on an empty broker: its CPU
   share over 30 s.
10. takeover: a scheduler's first acquisition (``takeover_seconds``: fence, fold, catch up,
   join the table, first batch out), eight starts in a row on a tasks topic of N deferred
   tasks, no checkpoint; median, min and max.

(2), (3) and (4) run on the embedded Tansu broker, on Apache Kafka with ``--backend kafka``
(or on DEFERLINE_BENCH_BOOTSTRAP=host:port).
The script uses public or long-standing APIs only, so another checkout's interpreter can run
it for "before" figures (``cd <checkout> && .venv/bin/python <this file>``).

Run: .venv/bin/python -m bench.bench_scheduler [--n 20000] [--only apply memory]
     .venv/bin/python -m bench.bench_scheduler --only restart --n 1000000 --backend kafka
     .venv/bin/python -m bench.bench_scheduler --only path apply --backend kafka
     .venv/bin/python -m bench.bench_scheduler --only states --n 50000
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deferline.engine import Pools, TaskTable
from deferline.runners.scheduler import Scheduler
from deferline.runners.scheduler import testing as scheduler_testing
from deferline.runners.scheduler.testing import read_as, waves
from deferline.schemas import (
    ResumeTarget,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    decode,
    encode,
    make_event_id,
    make_trigger_id,
)
from deferline.topics import Settings, TopicNames, make_producer

from bench._figures import Figure, Sitting, size_slug
from bench._harness import cpu_seconds, local_broker, member_gc_cadence, produce_batched

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
TARGET = ResumeTarget(operator="pkg.Op")


def life(n: int) -> tuple[list[TaskStateRecord], list[TriggerEventRecord]]:
    """Worker and client records (not the scheduler's) and the events of n tasks."""
    states: list[TaskStateRecord] = []
    events: list[TriggerEventRecord] = []
    for i in range(n):
        task = TaskKey(dag_id="bench", task_id=f"t{i}", run_id="r")
        trigger_id = make_trigger_id(task, 0)
        states.append(
            TaskStateRecord(
                task=task, state="scheduled", source="client", resume=TARGET, updated_at=T0
            )
        )
        states.append(TaskStateRecord(task=task, state="running", source="worker", updated_at=T0))
        states.append(
            TaskStateRecord(
                task=task,
                state="deferred",
                trigger_id=trigger_id,
                next_method="done",
                source="worker",
                updated_at=T0,
            )
        )
        events.append(
            TriggerEventRecord(
                event_id=make_event_id(trigger_id, "fired", i),
                trigger_id=trigger_id,
                task=task,
                status="fired",
                payload=i,
                emitted_at=T0,
            )
        )
    return states, events


def bench_fold(n: int) -> list[Figure]:
    states, events = life(n)
    table = TaskTable(pools=Pools(slots={}, default_slots=None))
    began = time.perf_counter()
    for record in states:
        table.apply(record)
        table.drain()
    folded_states = time.perf_counter() - began
    began = time.perf_counter()
    for event in events:
        table.apply(event)
    for event in events:
        table.apply(event)  # the duplicate copy
    out = table.drain()
    folded_events = time.perf_counter() - began
    assert table.counters.events_applied == n
    assert table.counters.events_duplicate == n
    assert len(out) == 2 * n
    print(
        f"fold     n={n:>7}  task records {len(states) / folded_states:>10,.0f}/s   "
        f"events (half duplicates) {2 * n / folded_events:>10,.0f}/s"
    )
    what = f"the pure fold, {n:,} task instances through a whole life"
    return [
        Figure(
            "scheduler.fold_records",
            f"{what}: task records",
            round(len(states) / folded_states),
            "records/s",
        ),
        Figure(
            "scheduler.fold_events",
            f"{what}: events (half duplicates)",
            round(2 * n / folded_events),
            "events/s",
        ),
    ]


async def bench_broker(n: int, backend: str) -> list[Figure]:
    states, events = life(n)
    async with local_broker(backend, os.environ.get("DEFERLINE_BENCH_BOOTSTRAP")) as bootstrap:
        settings = Settings(
            bootstrap_servers=bootstrap, topic_prefix=f"bench{uuid.uuid4().hex[:6]}.", partitions=12
        )
        names = TopicNames(settings.topic_prefix)
        pools = Pools(slots={}, default_slots=None)
        async with Scheduler(settings, pools=pools) as first:
            await first.wait_ready()
        producer = make_producer(settings, linger_ms=20, max_batch_size=512 * 1024)
        await producer.start()
        try:
            futures = [
                await producer.send(names.tasks, encode(r), key=r.task.ti_key.encode())
                for r in states
            ]
            await asyncio.gather(*futures)
            began = time.perf_counter()
            async with Scheduler(settings, pools=pools) as sched:
                await sched.wait_ready()
                rebuilt = time.perf_counter() - began
                rebuild = sched.recovered_records / rebuilt
                print(
                    f"rebuild  n={n:>7}  {sched.recovered_records} records in {rebuilt:6.2f}s  "
                    f"({sched.recovered_records / rebuilt:,.0f} records/s, "
                    f"scheduler's own decisions included)"
                )
                began = time.perf_counter()
                futures = [
                    await producer.send(names.task_events, encode(e), key=e.task.ti_key.encode())
                    for e in events
                ]
                await asyncio.gather(*futures)
                for _ in range(60_000):
                    if sched.table.counters.resumes >= n:
                        break
                    await asyncio.sleep(0.01)
                async with _publish_lock(sched):  # the last batch's records are handed over
                    pass
                applied = time.perf_counter() - began
                print(
                    f"live     n={n:>7}  {n} events → {sched.table.counters.resumes} resumes "
                    f"published in {applied:6.2f}s ({n / applied:,.0f} events/s, "
                    f"produce time included)"
                )
        finally:
            await producer.stop()
    return [
        Figure(
            "scheduler.rebuild",
            f"a scheduler's rebuild from the tasks topic ({n:,} tasks, no checkpoint)",
            round(rebuild),
            "records/s",
        ),
        Figure(
            "scheduler.live",
            f"{n:,} events produced at once → every resume published",
            round(n / applied),
            "events/s",
            note="produce time included",
        ),
    ]


def _deferred(states: list[TaskStateRecord]) -> list[TaskStateRecord]:
    return [r.model_copy(update={"resume": TARGET}) for r in states if r.state == "deferred"]


async def bench_apply(n: int, backend: str) -> list[Figure]:
    states, events = life(n)
    deferred = _deferred(states)
    async with local_broker(backend, os.environ.get("DEFERLINE_BENCH_BOOTSTRAP")) as bootstrap:
        settings = Settings(
            bootstrap_servers=bootstrap, topic_prefix=f"bench{uuid.uuid4().hex[:6]}.", partitions=12
        )
        names = TopicNames(settings.topic_prefix)
        pools = Pools(slots={}, default_slots=None)
        async with Scheduler(settings, pools=pools, transactions=False) as first:
            await first.wait_ready()  # creates the topics
        producer = make_producer(settings, linger_ms=20, max_batch_size=512 * 1024)
        await producer.start()
        try:
            futures = [
                await producer.send(names.tasks, encode(r), key=r.task.ti_key.encode())
                for r in deferred
            ]
            futures += [
                await producer.send(names.task_events, encode(e), key=e.task.ti_key.encode())
                for e in events
            ]
            await asyncio.gather(*futures)
        finally:
            await producer.stop()
        async with Scheduler(settings, pools=pools) as sched:
            await sched.wait_active()
            began, cpu = time.perf_counter(), time.process_time()
            for _ in range(120_000):
                if sched.table.counters.resumes >= n:
                    break
                await asyncio.sleep(0.005)
            await _published_and_read_back(sched)
            took, cpu = time.perf_counter() - began, time.process_time() - cpu
            mode = "transactions" if sched.transactional else "waves"
            print(
                f"apply    n={n:>7}  {backend:<6} {n} events applied in {took:6.2f}s "
                f"({n / took:,.0f}/s), "
                f"scheduler CPU {cpu:5.2f}s ({cpu / n * 1e6:,.0f} µs per resumed task, {mode})"
            )
    what = f"alone: {n:,} events already on the topic applied ({mode})"
    return [
        Figure("scheduler.apply", what, round(n / took), "events/s"),
        Figure("scheduler.apply_cpu", f"{what}: CPU per event", round(cpu / n * 1e6), "µs"),
    ]


async def bench_idle(exe: str, backend: str) -> list[Figure]:
    """A ``deferline scheduler`` process on an empty broker: CPU share over 30 s."""
    async with local_broker(backend, os.environ.get("DEFERLINE_BENCH_BOOTSTRAP")) as bootstrap:
        command = [exe, "scheduler", "--bootstrap-servers", bootstrap, "--log-level", "WARNING"]
        command += ["--topic-prefix", f"idle{uuid.uuid4().hex[:6]}."]
        process = await asyncio.create_subprocess_exec(*command, stderr=subprocess.DEVNULL)
        try:
            await asyncio.sleep(15.0)  # started, folded, active
            cpu0, t0 = cpu_seconds(process.pid), time.monotonic()
            await asyncio.sleep(30.0)
            share = (cpu_seconds(process.pid) - cpu0) / (time.monotonic() - t0)
        finally:
            process.terminate()
            await asyncio.wait_for(process.wait(), 30)
        print(f"idle     scheduler CPU {share * 100:.2f} % of a core (30 s, empty broker)")
    return [
        Figure(
            "scheduler.idle_cpu",
            "idle process on an empty broker",
            round(share * 100, 2),
            "% of a core",
        )
    ]


def _event_reader() -> Callable[[bytes], object]:
    """How the scheduler reads an event: into its fields where the build has them (an
    earlier build's checkout, for "before" figures, decodes the model)."""
    read_event: Callable[[bytes], object] | None = getattr(scheduler_testing, "read_event", None)
    return read_event or (lambda value: read_as(value, TriggerEventRecord))


def bench_path(n: int) -> list[Figure]:
    read = _event_reader()
    states, events = life(n)
    wire = [encode(e) for e in events]
    names = TopicNames("bench.")
    table = TaskTable(pools=Pools(slots={}, default_slots=None))
    for record in _deferred(states):
        table.apply(record)
    table.drain()
    sent = 0
    began, cpu = time.perf_counter(), time.process_time()
    for first in range(0, n, 10_000):
        for value in wire[first : first + 10_000]:
            table.apply(read(value))  # type: ignore[arg-type]  # what the build's reader gives
        sent += sum(len(wave) for wave in waves(names, table.drain(), written={}))
    took, cpu = time.perf_counter() - began, time.process_time() - cpu
    assert table.counters.resumes == n
    assert sent == 2 * n
    print(
        f"path     n={n:>7}  {n / took:>10,.0f} events/s decoded, folded, decisions encoded "
        f"({cpu / n * 1e6:5.1f} µs CPU each)"
    )
    return [
        Figure(
            "scheduler.path",
            f"the per-event path without a broker (decode, fold, encode; {n:,} events)",
            round(cpu / n * 1e6, 1),
            "µs",
            note=f"{n / took:,.0f} events/s",
        )
    ]


def bench_states(n: int) -> list[Figure]:
    states, _ = life(n)
    wire = [encode(r) for r in states]
    best = float("inf")
    for _ in range(3):
        table = TaskTable(pools=Pools(slots={}, default_slots=None))
        cpu = time.process_time()
        for value in wire:
            table.apply(read_as(value, TaskStateRecord))
        table.drain()
        best = min(best, time.process_time() - cpu)
    assert len(table) == n
    print(
        f"states   n={n:>7}  {len(wire) / best:>10,.0f} tasks-topic records/s decoded and "
        f"folded ({best / len(wire) * 1e6:5.1f} µs CPU each, best of 3)"
    )
    return [
        Figure(
            "scheduler.states",
            "tasks-topic records decoded and folded into a fresh table (a takeover's or a cold "
            "start's work), no broker",
            round(best / len(wire) * 1e6, 1),
            "µs per record",
            note="best of 3",
        )
    ]


def bench_memory(n: int) -> list[Figure]:
    states, events = life(n)
    wire = [encode(r) for r in states if r.state == "deferred"]
    fired = [encode(e) for e in events]
    del states, events
    gc.collect()
    table = TaskTable(pools=Pools(slots={}, default_slots=None))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for value in wire:
            table.apply(decode(value))  # type: ignore[arg-type]
        table.drain()
        deferred = tracemalloc.get_traced_memory()[0] - base
        for value in fired:
            table.apply(decode(value))  # type: ignore[arg-type]
        out = table.drain()
        for emit in out:
            if isinstance(emit.record, TaskStateRecord):
                table.apply(emit.record)  # read back
        del out, emit
        gc.collect()
        queued = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    print(
        f"memory   n={n:>7}  {deferred / n:,.0f} B per deferred task, "
        f"{queued / n:,.0f} B per resumed (queued) task"
    )
    return [
        Figure(
            f"scheduler.fold_memory_{size_slug(n)}",
            f"fold memory per task (tracemalloc), {n:,} tasks, deferred / resumed",
            f"{deferred / n:,.0f} / {queued / n:,.0f}",
            "B",
        )
    ]


def _deferred_rows(first: int, n: int) -> list[tuple[bytes, bytes]]:
    rows = []
    for i in range(first, first + n):
        task = TaskKey(dag_id="bench", task_id=f"t{i}", run_id="r")
        record = TaskStateRecord(
            task=task,
            state="deferred",
            trigger_id=make_trigger_id(task, 0),
            next_method="done",
            next_kwargs={"i": i},
            source="worker",
            resume=TARGET,
            updated_at=T0,
        )
        rows.append((task.ti_key.encode(), encode(record)))
    return rows


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def _published_and_read_back(sched: Scheduler) -> None:
    """Wait until every decision taken is handed to the producer, acknowledged and read
    back from the tasks topic (through this checkout's internals or the older ones)."""
    old: Any = sched
    if hasattr(sched, "settle"):
        await sched.settle()  # handed to the producers and acknowledged
    else:
        async with _publish_lock(sched):  # older checkouts: the last batch is handed over
            pass
        chain: Any = getattr(sched, "chain", None)
        if chain is not None:
            await chain.settle()  # and acknowledged (batches overlap)
    clients: Any = getattr(sched, "clients", None)
    reader: Any = clients.reader if clients is not None else getattr(sched, "_reader", None)
    caught_up = reader.caught_up if reader is not None else old._tasks_caught_up
    await caught_up()  # and read back


def _publish_lock(sched: Scheduler) -> asyncio.Lock:
    """The lock a fold holds while it hands its batches over (this checkout's or older)."""
    old: Any = sched
    writers: Any = getattr(sched, "writers", None)
    lock: asyncio.Lock = writers.lock if writers is not None else old._publish_lock
    return lock


def _checkpointed(sched: Scheduler) -> bool:
    """True once the scheduler wrote its first checkpoint (this checkout's or older)."""
    checkpoints: Any = getattr(sched, "checkpoints", None)
    if checkpoints is not None:
        return bool(checkpoints._saved)
    return getattr(sched, "_saved_positions", None) is not None


async def _time_to_ready(
    settings: Settings, pools: Pools, **options: object
) -> tuple[Scheduler, float]:
    """A started scheduler, and the seconds from start to ready (connect included)."""
    began = time.perf_counter()
    sched = Scheduler(settings, pools=pools, **options)  # type: ignore[arg-type]
    await sched.start()
    await sched.wait_ready()
    return sched, time.perf_counter() - began


async def _scheduler_topics(bootstrap: str) -> tuple[Settings, Pools]:
    """Settings of a fresh topic prefix with 12 partitions, its topics created by a first
    scheduler, and unbounded pools."""
    settings = Settings(
        bootstrap_servers=bootstrap, topic_prefix=f"bench{uuid.uuid4().hex[:6]}.", partitions=12
    )
    pools = Pools(slots={}, default_slots=None)
    async with Scheduler(settings, pools=pools) as first:
        await first.wait_ready()  # creates the topics
    return settings, pools


async def bench_restart(n: int, backend: str) -> list[Figure]:
    tail = max(1, n // 100)
    async with local_broker(backend, os.environ.get("DEFERLINE_BENCH_BOOTSTRAP")) as bootstrap:
        settings, pools = await _scheduler_topics(bootstrap)
        names = TopicNames(settings.topic_prefix)
        producer = make_producer(settings, linger_ms=20, max_batch_size=512 * 1024)
        await producer.start()
        try:
            await produce_batched(producer, names.tasks, _deferred_rows(0, n), settings.partitions)
            state_dir = Path(tempfile.mkdtemp(prefix="deferline-bench-"))
            cold, cold_seconds = await _time_to_ready(settings, pools)
            print(
                f"restart  n={n:>7}  {backend:<6} cold (no checkpoint): ready in "
                f"{cold_seconds:6.2f}s, {cold.recovered_records} records folded"
            )
            await cold.stop()
            del cold
            gc.collect()
            saver, _ = await _time_to_ready(settings, pools, state_dir=state_dir)
            began = time.perf_counter()
            while not _checkpointed(saver):  # noqa: ASYNC110 - polling a figure
                await asyncio.sleep(0.01)  # until the first checkpoint (every task) is out
            wrote = time.perf_counter() - began
            await saver.stop()
            size = _disk_bytes(state_dir)
            print(
                f"restart  n={n:>7}  {backend:<6} first checkpoint written after ready in "
                f"{wrote:6.2f}s, {size / 1e6:,.0f} MB on disk ({size / n:,.0f} B per task)"
            )
            del saver
            gc.collect()
            await produce_batched(
                producer, names.tasks, _deferred_rows(n, tail), settings.partitions
            )
            warm, warm_seconds = await _time_to_ready(settings, pools, state_dir=state_dir)
            print(
                f"restart  n={n:>7}  {backend:<6} from checkpoint: ready in "
                f"{warm_seconds:6.2f}s ({warm.restored_tasks} tasks restored in "
                f"{warm.restore_seconds or 0.0:.2f}s, {warm.recovered_records} tail records "
                f"folded), "
                f"{cold_seconds / warm_seconds:,.1f}x faster than cold"
            )
            assert len(warm.table) == n + tail
            restored_in = warm.restore_seconds or 0.0
            await warm.stop()
            del warm
            gc.collect()
            # The same restart with standby tables: alone, it takes every partition over.
            await produce_batched(
                producer, names.tasks, _deferred_rows(n + tail, tail), settings.partitions
            )
            kept, kept_seconds = await _time_to_ready(
                settings, pools, state_dir=state_dir, standby=True
            )
            print(
                f"restart  n={n:>7}  {backend:<6} from checkpoint, --standby: ready in "
                f"{kept_seconds:6.2f}s ({kept.restored_tasks} tasks restored, "
                f"{kept.recovered_records} tail records folded by the takeover, "
                f"{kept.standby.records if kept.standby else 0} by the standby before)"
            )
            assert len(kept.table) == n + 2 * tail
            await kept.stop()
        finally:
            await producer.stop()
    slug = size_slug(n)
    return [
        Figure(
            f"restart.scheduler_{slug}",
            f"scheduler, {n:,} tasks: start → ready from its checkpoint",
            round(warm_seconds, 2),
            "s",
            note=f"restore {restored_in:.2f} s; cold {cold_seconds:.2f} s",
        ),
        Figure(
            f"restart.scheduler_standby_{slug}",
            f"scheduler, {n:,} tasks, `--standby`: start → ready from its checkpoint",
            round(kept_seconds, 2),
            "s",
        ),
        Figure(
            f"restart.first_checkpoint_{slug}",
            f"scheduler, {n:,} tasks: first checkpoint written, after ready",
            round(wrote, 2),
            "s",
        ),
        Figure(
            "restart.checkpoint_size", "scheduler checkpoint on disk", round(size / n), "B per task"
        ),
    ]


async def bench_takeover(n: int, backend: str, rounds: int = 8) -> list[Figure]:
    """A scheduler's first acquisition, ``rounds`` times: one starts on a tasks topic of
    ``n`` deferred tasks (no checkpoint) and takes every partition over."""
    async with local_broker(backend, os.environ.get("DEFERLINE_BENCH_BOOTSTRAP")) as bootstrap:
        settings, pools = await _scheduler_topics(bootstrap)
        producer = make_producer(settings, linger_ms=20, max_batch_size=512 * 1024)
        await producer.start()
        try:
            names = TopicNames(settings.topic_prefix)
            await produce_batched(producer, names.tasks, _deferred_rows(0, n), settings.partitions)
        finally:
            await producer.stop()
        seconds = []
        for _ in range(rounds):
            sched, _ready = await _time_to_ready(settings, pools)
            seconds.append(sched.figures.takeover_seconds or 0.0)
            await sched.stop()
        seconds.sort()
        print(
            f"takeover n={n:>7}  {backend:<6} first acquisition of 12 partitions, {rounds} starts: "
            f"median {seconds[len(seconds) // 2]:.3f}s, min {seconds[0]:.3f}s, "
            f"max {seconds[-1]:.3f}s"
        )
    return [
        Figure(
            f"restart.first_acquisition_{size_slug(n)}",
            f"a scheduler's first acquisition of 12 partitions ({n:,} tasks, no checkpoint), "
            f"{rounds} starts: `takeover_seconds` median",
            round(seconds[len(seconds) // 2], 3),
            "s",
            note=f"{seconds[0]:.3f} to {seconds[-1]:.3f} s",
        )
    ]


CASES = ("fold", "broker", "apply", "memory", "restart", "idle", "path", "states", "takeover")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--only", nargs="+", choices=CASES, default=CASES[:4])
    parser.add_argument(
        "--deferline",
        default=str(Path(sys.executable).with_name("deferline")),
        help="the executable the idle case runs (another checkout's, for before/after)",
    )
    parser.add_argument(
        "--default-gc",
        action="store_true",
        help="keep CPython's GC thresholds (the scheduler command collects less often)",
    )
    parser.add_argument("--backend", choices=("tansu", "kafka"), default="tansu")
    args = parser.parse_args()
    on_broker = {"broker", "apply", "restart", "takeover", "idle"} & set(args.only)
    sitting = Sitting.begin(
        "scheduler",
        broker=args.backend if on_broker else "none",
        deferline=args.deferline if "idle" in args.only else None,
    )
    if not args.default_gc:
        member_gc_cadence()  # as the build's member processes collect
    figures: list[Figure] = []
    if "fold" in args.only:
        figures += bench_fold(args.n)
    if "broker" in args.only:
        figures += asyncio.run(bench_broker(args.n, args.backend))
    if "apply" in args.only:
        figures += asyncio.run(bench_apply(args.n, args.backend))
    if "path" in args.only:
        figures += bench_path(args.n)
    if "states" in args.only:
        figures += bench_states(args.n)
    if "memory" in args.only:
        figures += bench_memory(args.n)
    if "restart" in args.only:
        figures += asyncio.run(bench_restart(args.n, args.backend))
    if "takeover" in args.only:
        figures += asyncio.run(bench_takeover(args.n, args.backend))
    if "idle" in args.only:
        figures += asyncio.run(bench_idle(args.deferline, args.backend))
    sitting.write(figures)


if __name__ == "__main__":
    main()
