"""Worker throughput on the embedded broker: RunTasks handled per second, and slot time each.

Run: .venv/bin/python -m bench.bench_worker [--tasks N] [--slots S]
Three workloads, each N RunTasks already waiting on the queue when the worker starts:
``succeed`` (operator returns at once), ``defer`` (operator defers: "deferred" state plus
DeferRequest, each acknowledged) and ``resume`` (resume RunTasks into a method that returns).
Prints a Markdown table and records it (bench/_figures.py).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from deferline.runners.worker import Worker
from deferline.schemas import RunTask, TaskKey, encode, make_trigger_id
from deferline.topics import Settings, TansuBroker, TopicNames, make_producer

from bench._figures import Figure, Sitting

EXAMPLES = "deferline.engine.examples"


def runs(workload: str, n: int) -> list[RunTask]:
    kinds: dict[str, dict[str, Any]] = {
        "succeed": {"mode": "start", "operator": "FlakyOperator", "op_kwargs": {"fail_tries": 0}},
        "defer": {"mode": "start", "operator": "WaitOperator", "op_kwargs": {"seconds": 3600}},
        "resume": {
            "mode": "resume",
            "operator": "StartFromTriggerWaitOperator",
            "op_kwargs": {"seconds": 1},
            "next_method": "execute_complete",
            "event": 1,
        },
    }
    fields = kinds[workload]
    out = []
    for i in range(n):
        task = TaskKey(dag_id="bench", task_id=f"{workload}{i}", run_id="r")
        extra = {"trigger_id": make_trigger_id(task, 0)} if fields["mode"] == "resume" else {}
        out.append(
            RunTask(
                task=task,
                **{**fields, "operator": f"{EXAMPLES}.{fields['operator']}"},
                **extra,
            )
        )
    return out


async def measure(bootstrap: str, workload: str, n: int, slots: int) -> dict[str, Any]:
    settings = Settings(bootstrap_servers=bootstrap, topic_prefix=f"bench{workload}.", partitions=4)
    names = TopicNames(settings.topic_prefix)
    producer = make_producer(settings, linger_ms=5)
    worker = Worker(settings, slots=slots, session_timeout_ms=6_000, heartbeat_interval_ms=500)
    await worker.start()  # creates the topics and joins; the queue is empty so far
    await worker.wait_ready()
    await producer.start()
    try:
        batch = runs(workload, n)
        started = time.perf_counter()
        sends = [
            await producer.send(
                names.work() if r.mode == "start" else names.resumes(),
                encode(r),
                key=r.task.ti_key.encode(),
            )
            for r in batch
        ]
        await asyncio.gather(*sends)

        def handled() -> int:
            m = worker.metrics
            return m.succeeded + m.deferred + m.failed + m.duplicates

        while handled() < n:  # noqa: ASYNC110 - polling a counter every 10 ms
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - started
    finally:
        await producer.stop()
        await worker.stop()
    return {
        "workload": workload,
        "n": n,
        "seconds": elapsed,
        "per_s": n / elapsed,
        "slot_ms": 1000 * worker.metrics.slot_seconds / n,
        "failed": worker.metrics.failed,
    }


async def main(n: int, slots: int) -> None:
    sitting = Sitting.begin("worker", broker="tansu")
    async with TansuBroker() as broker:
        rows = [
            await measure(broker.bootstrap, w, n, slots) for w in ("succeed", "defer", "resume")
        ]
    print(f"Worker with {slots} slots, {n} RunTasks per workload, embedded Tansu broker\n")
    print("| workload | RunTasks | seconds | RunTasks/s | slot ms per run |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['n']} | {r['seconds']:.2f} | {r['per_s']:.0f} "
            f"| {r['slot_ms']:.2f} |"
        )
        if r["failed"]:
            print(f"(!) {r['failed']} failed")
    sitting.write(
        Figure(
            f"worker.{r['workload']}_{slots}_slots",
            f"{n:,} RunTasks waiting, one worker with {slots} slots: {r['workload']}",
            round(r["per_s"]),
            "RunTasks/s",
            note=f"{r['slot_ms']:.2f} slot ms per run"
            + (f"; {r['failed']} failed" if r["failed"] else ""),
        )
        for r in rows
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--slots", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(main(args.tasks, args.slots))
