"""Replay of a million-record topic set: rate and peak memory of `stuck` and `why`.

Produces a realistic history first (batched producer): most tasks run the whole loop
(scheduled → queued → start → running → deferred → DeferRequest → event and its copy on
tasks.events → tombstone → queued → resume → running → success, 13 records), a fraction
stays stuck in one of three
ways (never requested, requested without an event, fired but not applied). Then each replay
runs in a fresh subprocess so its peak RSS is its own:

- ``stuck``: two passes (tasks topic, then every topic filtered to the stuck set), verdicts;
- ``why``: one task, byte-level pre-filter, then a follow-up pass;
- ``baseline``: the same process reading nothing (``to_offset=0``): interpreter, imports,
  clients — what memory the replay itself adds is the difference.

Run: .venv/bin/python -m bench.bench_replay                  (embedded Tansu broker)
     .venv/bin/python -m bench.bench_replay --backend kafka  (Apache Kafka from its jars)
     .venv/bin/python -m bench.bench_replay --records 100000 --bootstrap HOST:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import resource
import subprocess
import sys
import time
import uuid
from collections import Counter
from typing import Any

PER_TASK = 12


def _records_for(n_records: int, stuck_every: int) -> tuple[int, int]:
    """How many tasks make about n_records, and how many of them are stuck."""
    tasks = n_records // PER_TASK
    return tasks, tasks // stuck_every


async def produce(bootstrap: str, prefix: str, n_records: int, stuck_every: int) -> dict[str, Any]:
    from deferline.schemas import (
        DeferRequest,
        ResumeTarget,
        RunTask,
        TaskKey,
        TaskStateRecord,
        TriggerEventRecord,
        encode,
        make_event_id,
        make_trigger_id,
    )
    from deferline.topics import (
        Settings,
        TopicNames,
        ensure_topics,
        make_producer,
        partition_for,
        topic_specs,
    )

    settings = Settings(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions=12)
    names = TopicNames(prefix)
    await ensure_topics(settings, topic_specs(settings, worker_queues=["default"]))
    target = ResumeTarget(operator="bench.ops.Wait")
    base = dt.datetime.now(dt.UTC) - dt.timedelta(hours=3)
    tasks, stuck = _records_for(n_records, stuck_every)
    step = dt.timedelta(hours=2) / max(tasks, 1)  # every task starts 1-3 hours ago
    producer = make_producer(settings, acks=1, linger_ms=20, max_batch_size=512 * 1024)
    await producer.start()
    sent = 0
    pending: list[Any] = []
    started = time.perf_counter()

    async def send(topic: str, key: str, record: Any | None, at: dt.datetime) -> None:
        nonlocal sent
        kb = key.encode()
        value = encode(record) if record is not None else None
        pending.append(
            await producer.send(
                topic,
                value,
                key=kb,
                partition=partition_for(kb, 12),
                timestamp_ms=int(at.timestamp() * 1000),
            )
        )
        sent += 1
        if len(pending) >= 20_000:
            await asyncio.gather(*pending)
            pending.clear()

    kinds: Counter[str] = Counter()
    for i in range(tasks):
        t0 = base + step * i
        task = TaskKey(dag_id="bench", task_id=f"t{i}", run_id="run1")
        key = task.ti_key
        tid = make_trigger_id(task, 0)
        mode = (i // stuck_every) % 3 if i % stuck_every == 0 and i // stuck_every < stuck else -1

        def state(
            name: str, at: dt.datetime, task: TaskKey = task, **fields: Any
        ) -> TaskStateRecord:
            return TaskStateRecord(task=task, state=name, updated_at=at, **fields)

        await send(names.tasks, key, state("scheduled", t0, source="client", resume=target), t0)
        t1 = t0 + dt.timedelta(milliseconds=5)
        await send(names.tasks, key, state("queued", t1, resume=target), t1)
        run = RunTask(task=task, mode="start", operator=target.operator, enqueued_at=t1)
        await send(names.work(), key, run, t1)
        t2 = t1 + dt.timedelta(milliseconds=5)
        await send(names.tasks, key, state("running", t2, source="worker"), t2)
        t3 = t2 + dt.timedelta(milliseconds=5)
        deferred = state(
            "deferred",
            t3,
            source="worker",
            trigger_id=tid,
            next_method="execute_complete",
            resume=target,
        )
        await send(names.tasks, key, deferred, t3)
        if mode == 0:
            kinds["never_requested"] += 1
            continue
        moment = t3 + dt.timedelta(seconds=30)
        request = DeferRequest(
            trigger_id=tid,
            task=task,
            classpath="deferline.engine.triggers.DateTimeTrigger",
            kwargs={"moment": moment},
            requested_at=t3,
            resume=target,
        )
        await send(names.defer(), tid, request, t3)
        if mode == 1:
            kinds["no_event"] += 1
            continue
        event = TriggerEventRecord(
            event_id=make_event_id(tid, "fired", moment.isoformat()),
            trigger_id=tid,
            task=task,
            status="fired",
            payload=moment.isoformat(),
            due_at=moment,
            emitted_at=moment + dt.timedelta(milliseconds=3),
            member=f"trig-{partition_for(tid.encode(), 12) % 3}",  # 3 members, 4 partitions each
            partition=partition_for(tid.encode(), 12),
        )
        await send(names.resume(), tid, event, event.emitted_at)
        await send(names.task_events, task.ti_key, event, event.emitted_at)
        await send(names.defer(), tid, None, event.emitted_at)
        if mode == 2:
            kinds["fired_not_applied"] += 1
            continue
        t4 = event.emitted_at
        applied = state(
            "queued",
            t4,
            trigger_id=tid,
            event_id=event.event_id,
            event=event.payload,
            next_method="execute_complete",
            resume=target,
        )
        await send(names.tasks, key, applied, t4)
        resume = RunTask(
            task=task,
            mode="resume",
            operator=target.operator,
            trigger_id=tid,
            event_id=event.event_id,
            next_method="execute_complete",
            enqueued_at=t4,
        )
        await send(names.resumes(), key, resume, t4)
        t5 = t4 + dt.timedelta(milliseconds=5)
        await send(names.tasks, key, state("running", t5, source="worker"), t5)
        t6 = t5 + dt.timedelta(milliseconds=5)
        await send(names.tasks, key, state("success", t6, source="worker"), t6)
        kinds["complete"] += 1
    await asyncio.gather(*pending)
    await producer.stop()
    took = time.perf_counter() - started
    return {"records": sent, "tasks": tasks, "seconds": took, "rate": sent / took, **kinds}


async def replay(bootstrap: str, prefix: str, mode: str) -> dict[str, Any]:
    from deferline.replay import ReadBounds, ReplaySession, parse_subject
    from deferline.topics import Settings

    settings = Settings(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions=12)
    bounds = ReadBounds(to_offset=0) if mode == "baseline" else None
    started = time.perf_counter()
    out: dict[str, Any] = {"mode": mode}
    async with ReplaySession(settings, bounds=bounds, live=False) as session:
        if mode in ("stuck", "baseline"):
            reports = await session.stuck(older_than=dt.timedelta(minutes=10))
            out["stuck"] = len(reports)
            out["verdicts"] = dict(Counter(r.verdict.kind.value for r in reports))
        else:
            verdict, timeline = await session.why(parse_subject("bench/t0/run1"))
            out["verdict"] = verdict.kind.value
            out["timeline"] = len(timeline)
        read = session.reader.records_read
    took = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.update(
        records_read=read,
        seconds=took,
        rate=read / took if took else 0.0,
        peak_rss_mb=_peak_rss_mb(usage),
        cpu_s=usage.ru_utime + usage.ru_stime,
    )
    return out


def _peak_rss_mb(usage: resource.struct_rusage) -> float:
    """Peak RSS of this process image: VmHWM (ru_maxrss keeps the forking parent's peak)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return usage.ru_maxrss / 1024


def child(bootstrap: str, prefix: str, mode: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--bootstrap", bootstrap, "--prefix", prefix]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


async def _start_broker(backend: str) -> Any:
    from deferline.topics import KRaftBroker, TansuBroker

    broker = TansuBroker() if backend == "tansu" else KRaftBroker()
    await broker.start()
    return broker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--stuck-every", type=int, default=100, help="one task in N is stuck")
    parser.add_argument("--backend", choices=["tansu", "kafka"], default="tansu")
    parser.add_argument("--bootstrap", help="use this cluster instead of starting a broker")
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=["stuck", "why", "baseline"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(replay(args.bootstrap, args.prefix, args.child))))
        return

    from bench._figures import Figure, Sitting, size_slug  # the children run as files

    sitting = Sitting.begin("replay", broker=args.backend)
    broker = None if args.bootstrap else asyncio.run(_start_broker(args.backend))
    bootstrap: str = args.bootstrap or broker.bootstrap  # type: ignore[union-attr]
    prefix = f"bench{uuid.uuid4().hex[:8]}."
    try:
        print(
            f"# {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cpus, "
            f"broker {args.bootstrap or args.backend}"
        )
        made = asyncio.run(produce(bootstrap, prefix, args.records, args.stuck_every))
        print(
            f"produced {made['records']:,} records ({made['tasks']:,} tasks) in "
            f"{made['seconds']:.1f} s = {made['rate']:,.0f} rec/s; "
            f"stuck: {made.get('never_requested', 0)} never requested, "
            f"{made.get('no_event', 0)} without event, "
            f"{made.get('fired_not_applied', 0)} fired not applied"
        )
        print(
            f"{'replay':<10} {'records read':>13} {'seconds':>8} {'rec/s':>10} "
            f"{'peak RSS MB':>12} {'CPU s':>7}  result"
        )
        figures = []
        for mode in ("baseline", "stuck", "why"):
            r = child(bootstrap, prefix, mode)
            result = r.get("verdicts", r.get("verdict", "-"))
            print(
                f"{mode:<10} {r['records_read']:>13,} {r['seconds']:>8.1f} {r['rate']:>10,.0f} "
                f"{r['peak_rss_mb']:>12.0f} {r['cpu_s']:>7.1f}  {result}"
            )
            if mode != "baseline":
                what = "`replay stuck`" if mode == "stuck" else "`replay why` one task"
                figures.append(
                    Figure(
                        f"replay.{mode}_{size_slug(args.records)}",
                        f"{what} over {made['records']:,} records",
                        round(r["rate"]),
                        "records/s",
                        note=f"peak RSS {r['peak_rss_mb']:.0f} MB; {r['records_read']:,} read",
                    )
                )
        sitting.write(figures)
    finally:
        if broker is not None:
            asyncio.run(broker.stop())


if __name__ == "__main__":
    main()
