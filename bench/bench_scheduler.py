"""Scheduler figures: the pure fold, a rebuild from the tasks topic, and events applied live.

1. fold: N task instances through a whole life (scheduled → queued → running → deferred →
   fired → queued → running → success) in one TaskTable, plus one duplicate event each.
   Reported: records folded per second (tasks-topic records and events).
2. rebuild: the tasks topic holds the records of N tasks (about 4 per task); a Scheduler
   starts and folds it to the end. Reported: seconds and records per second until ready.
3. live: N deferred tasks, N events produced at once; reported: seconds until the scheduler
   published every resume, events applied per second.

(2) and (3) run on the embedded Tansu broker (or DEFERLINE_BENCH_BOOTSTRAP=host:port).

Run: .venv/bin/python -m bench.bench_scheduler [--n 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import time
import uuid

from deferline.engine import Pools, TaskTable
from deferline.runners.scheduler import Scheduler
from deferline.schemas import (
    ResumeTarget,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    encode,
    make_event_id,
    make_trigger_id,
)
from deferline.topics import Settings, TopicNames, make_producer

from bench._harness import local_broker

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


def bench_fold(n: int) -> None:
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


async def bench_broker(n: int) -> None:
    states, events = life(n)
    async with local_broker("tansu", os.environ.get("DEFERLINE_BENCH_BOOTSTRAP")) as bootstrap:
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
                print(
                    f"rebuild  n={n:>7}  {sched.recovered_records} records in {rebuilt:6.2f}s  "
                    f"({sched.recovered_records / rebuilt:,.0f} records/s, "
                    f"scheduler's own decisions included)"
                )
                began = time.perf_counter()
                futures = [
                    await producer.send(names.resume(), encode(e), key=e.trigger_id.encode())
                    for e in events
                ]
                await asyncio.gather(*futures)
                for _ in range(60_000):
                    if sched.table.counters.resumes >= n:
                        break
                    await asyncio.sleep(0.01)
                async with sched._publish_lock:  # the last batch's records are acked
                    pass
                applied = time.perf_counter() - began
                print(
                    f"live     n={n:>7}  {n} events → {sched.table.counters.resumes} resumes "
                    f"published in {applied:6.2f}s ({n / applied:,.0f} events/s, "
                    f"produce time included)"
                )
        finally:
            await producer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    args = parser.parse_args()
    bench_fold(args.n)
    asyncio.run(bench_broker(args.n))


if __name__ == "__main__":
    main()
