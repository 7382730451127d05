"""The broker-failover scenario shared by tests/integration/test_cluster_failover.py (which
asserts its counts) and bench/bench_broker_failover.py (which reports its lags); see there.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer
from deferline.engine import Pools
from deferline.runners.scheduler import Scheduler
from deferline.runners.triggerer import Triggerer, TriggererOptions
from deferline.schemas import (
    DeferRequest,
    ResumeTarget,
    RunTask,
    SchemaError,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    decode,
    encode,
    make_trigger_id,
    utcnow,
)
from deferline.topics import (
    KRaftCluster,
    Settings,
    TopicNames,
    ensure_topics,
    make_admin,
    make_consumer,
    make_producer,
    supports_idempotence,
    topic_specs,
)

from tests._until import until

DATETIME = "deferline.engine.triggers.DateTimeTrigger"
TARGET = ResumeTarget(operator="deferline.engine.examples.WaitOperator")


@dataclass
class FailoverResult:
    """What one run saw; the counts are what a test asserts, the lags what a bench reports."""

    n: int
    killed_node: int
    leaders_before: dict[int, int]
    fired: int = 0
    resumed_tasks: int = 0
    duplicate_resumes: int = 0
    events_total: int = 0
    still_deferred: int = 0
    late_batch_fired: int = 0
    late_batch: int = 0
    event_lag: list[float] = field(default_factory=list)
    event_lag_while_down: list[float] = field(default_factory=list)
    event_lag_before_kill: list[float] = field(default_factory=list)
    resume_lag: list[float] = field(default_factory=list)
    resume_lag_while_down: list[float] = field(default_factory=list)
    longest_event_gap_s: float = 0.0
    down_s: float = 0.0
    idempotent: bool = True
    scheduler_failed: str | None = None
    triggerer_failed: str | None = None

    def summary(self) -> dict[str, Any]:
        def q(values: list[float], p: float) -> float:
            if not values:
                return float("nan")
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

        return {
            "n": self.n,
            "idempotent_producers": self.idempotent,
            "fired": self.fired,
            "resumed_tasks": self.resumed_tasks,
            "duplicate_resumes": self.duplicate_resumes,
            "still_deferred": self.still_deferred,
            "killed_node": self.killed_node,
            "leaders_before": self.leaders_before,
            "down_s": round(self.down_s, 1),
            "event_lag_before_kill_p50_s": round(q(self.event_lag_before_kill, 0.5), 3),
            "event_lag_before_kill_max_s": round(
                max(self.event_lag_before_kill, default=float("nan")), 3
            ),
            "event_lag_p50_s": round(q(self.event_lag, 0.5), 3),
            "event_lag_p99_s": round(q(self.event_lag, 0.99), 3),
            "event_lag_max_s": round(max(self.event_lag, default=float("nan")), 3),
            "event_lag_while_down_p50_s": round(q(self.event_lag_while_down, 0.5), 3),
            "event_lag_while_down_max_s": round(
                max(self.event_lag_while_down, default=float("nan")), 3
            ),
            "resume_lag_p50_s": round(q(self.resume_lag, 0.5), 3),
            "resume_lag_max_s": round(max(self.resume_lag, default=float("nan")), 3),
            "resume_lag_while_down_max_s": round(
                max(self.resume_lag_while_down, default=float("nan")), 3
            ),
            "longest_event_gap_s": round(self.longest_event_gap_s, 3),
            "late_batch_fired": f"{self.late_batch_fired}/{self.late_batch}",
        }


class TopicWatch:
    """Reads a topic from the start in the background; records (arrival time, value)."""

    def __init__(self, settings: Settings, topic: str) -> None:
        self.settings = settings
        self.topic = topic
        self.seen: list[tuple[float, Any]] = []
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> TopicWatch:
        self._consumer = make_consumer(self.settings, self.topic, group_id=None)
        await self._consumer.start()
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()

    async def _read(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=200, max_records=5000)
            now = time.time()
            for batch in batches.values():
                for record in batch:
                    if record.value is None:
                        continue
                    with contextlib.suppress(SchemaError):
                        self.seen.append((now, decode(record.value)))


def failover_task(i: int, run: str) -> TaskKey:
    return TaskKey(dag_id="failover", task_id="wait", run_id=f"{run}-{i}")


def deferral(i: int, run: str, due: dt.datetime) -> tuple[TaskStateRecord, DeferRequest]:
    task = failover_task(i, run)
    trigger_id = make_trigger_id(task, 0)
    state = TaskStateRecord(
        task=task,
        state="deferred",
        trigger_id=trigger_id,
        next_method="execute_complete",
        resume=TARGET,
        source="worker",
        updated_at=utcnow(),
    )
    request = DeferRequest(
        trigger_id=trigger_id, task=task, classpath=DATETIME, kwargs={"moment": due}
    )
    return state, request


async def publish(settings: Settings, records: list[tuple[str, bytes, bytes]]) -> None:
    producer = make_producer(settings, linger_ms=20, max_batch_size=512 * 1024)
    await producer.start()
    try:
        for start in range(0, len(records), 5000):
            futures = [
                await producer.send(topic, value=value, key=key)
                for topic, key, value in records[start : start + 5000]
            ]
            await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def _leaders(settings: Settings, topics: list[str]) -> dict[int, int]:
    admin = make_admin(settings)
    await admin.start()
    try:
        metadata = await admin.describe_topics(topics)
    finally:
        await admin.close()
    counts: Counter[int] = Counter()
    for topic in metadata:
        for partition in topic["partitions"]:
            counts[partition["leader"]] += 1
    return dict(counts)


async def run_failover(
    cluster: KRaftCluster,
    *,
    n: int = 20_000,
    window: float = 20.0,
    partitions: int = 6,
    state_dir: Path | None = None,
    kill: bool = True,
) -> FailoverResult:
    """Run the scenario on a started cluster; restarts the killed node before returning.

    ``kill=False`` runs the same timeline without killing anything (the control run).
    """
    settings = Settings(
        bootstrap_servers=cluster.bootstrap,
        client_id="deferline-failover",
        topic_prefix=f"f{uuid.uuid4().hex[:8]}.",
        partitions=partitions,
        replication_factor=3,
    )
    # Idempotent producers where the brokers grant them (Apache Kafka does; Tansu does not).
    idempotent = await supports_idempotence(settings)
    settings = settings.model_copy(update={"enable_idempotence": idempotent})
    names = TopicNames(settings.topic_prefix)
    specs = topic_specs(settings)
    await ensure_topics(settings, specs)
    run = uuid.uuid4().hex[:6]
    leaders = await _leaders(settings, [s.name for s in specs])
    victim = max(leaders, key=lambda node: leaders[node])
    result = FailoverResult(n=n, killed_node=victim, leaders_before=leaders, idempotent=idempotent)
    options = TriggererOptions(
        capacity=n + 1000,
        session_timeout_ms=10_000,
        checkpoint_interval=1.0,
        state_dir=state_dir,
    )
    stack = contextlib.AsyncExitStack()
    async with stack:
        events = await stack.enter_async_context(TopicWatch(settings, names.resume()))
        resumes = await stack.enter_async_context(TopicWatch(settings, names.resumes()))
        scheduler = await stack.enter_async_context(
            Scheduler(settings, pools=Pools(slots={}, default_slots=None), commit_interval=0.5)
        )
        await scheduler.wait_ready()
        await stack.enter_async_context(Triggerer(settings, options))
        # Task states first (they carry no due time), then the DeferRequests, published
        # well before the window opens so every timer is loaded when it falls due.
        tasks = [deferral(i, run, dt.datetime.fromtimestamp(0, dt.UTC)) for i in range(n)]
        await publish(
            settings,
            [(names.tasks, s.task.ti_key.encode(), encode(s)) for s, _ in tasks],
        )
        base = time.time() + 10.0 + n / 2000
        due_at: dict[str, float] = {}
        requests: list[tuple[str, bytes, bytes]] = []
        for i, (_, template) in enumerate(tasks):
            due = base + window * i / n
            request = template.model_copy(
                update={"kwargs": {"moment": dt.datetime.fromtimestamp(due, dt.UTC)}}
            )
            due_at[request.trigger_id] = due
            requests.append((names.defer(), request.trigger_id.encode(), encode(request)))
        await publish(settings, requests)
        if time.time() > base:
            raise AssertionError(
                f"publishing took {time.time() - base:.1f}s longer than the margin before the "
                "first timer"
            )
        kill_at = base + window / 4
        restart_at = base + window / 2
        await asyncio.sleep(max(0.0, kill_at - time.time()))
        killed = time.time()
        if kill:
            cluster.kill(victim)
        await asyncio.sleep(max(0.0, restart_at - time.time()))
        if kill:
            await cluster.restart(victim)
        back = time.time()
        result.down_s = back - killed

        # A small batch due after the restart: the same processes keep working.
        late = min(200, max(10, n // 100))
        late_base = time.time() + 3.0
        late_requests = []
        late_states = []
        for i in range(late):
            state, request = deferral(
                i, f"{run}-late", dt.datetime.fromtimestamp(late_base + i / late, dt.UTC)
            )
            late_states.append((names.tasks, state.task.ti_key.encode(), encode(state)))
            late_requests.append((names.defer(), request.trigger_id.encode(), encode(request)))
        await publish(settings, late_states)
        await publish(settings, late_requests)
        total = n + late

        def fired() -> set[str]:
            return {
                v.trigger_id
                for _, v in events.seen
                if isinstance(v, TriggerEventRecord) and v.status == "fired"
            }

        def resumed() -> list[RunTask]:
            return [v for _, v in resumes.seen if isinstance(v, RunTask) and v.mode == "resume"]

        await until(
            lambda: len(fired()) >= total,
            within=180 + n / 200,
            interval=0.1,
            what=lambda: f"every trigger fired ({len(fired())} of {total})",
        )
        await until(
            lambda: len({r.task.ti_key for r in resumed()}) >= total,
            within=120 + n / 200,
            interval=0.1,
            what=lambda: (
                f"every task resumed ({len({r.task.ti_key for r in resumed()})} of {total}; "
                f"{len(fired())} fired; scheduler {scheduler.phase.phase.value}, writing for "
                f"{scheduler.owned}, {scheduler.figures.rebalances} rebalances, "
                f"{scheduler.figures.partitions_fenced} fenced, "
                f"events lag {scheduler.housekeeping.events_lag})"
            ),
        )
        await asyncio.sleep(2.0)  # a duplicate, if any, would land now

        first_event: dict[str, float] = {}
        arrivals: list[float] = []
        for arrived, value in events.seen:
            if isinstance(value, TriggerEventRecord) and value.status == "fired":
                first_event.setdefault(value.trigger_id, arrived)
                arrivals.append(arrived)
        per_task = Counter(r.task.ti_key for r in resumed())
        first_resume: dict[str, float] = {}
        for arrived, value in resumes.seen:
            if isinstance(value, RunTask) and value.mode == "resume":
                first_resume.setdefault(value.trigger_id or "", arrived)
        result.events_total = sum(1 for _, v in events.seen if isinstance(v, TriggerEventRecord))
        late_ids = {make_trigger_id(failover_task(i, f"{run}-late"), 0) for i in range(late)}
        result.late_batch = late
        result.late_batch_fired = len(late_ids & set(first_event))
        main_ids = set(due_at)
        result.fired = len(main_ids & set(first_event))
        result.resumed_tasks = sum(
            1 for key in per_task if not key.split("/")[2].startswith(f"{run}-late")
        )
        result.duplicate_resumes = sum(count - 1 for count in per_task.values())
        for trigger_id, due in due_at.items():
            if trigger_id in first_event:
                lag = first_event[trigger_id] - due
                result.event_lag.append(lag)
                if killed <= due <= back:
                    result.event_lag_while_down.append(lag)
                elif due < killed:
                    result.event_lag_before_kill.append(lag)
            if trigger_id in first_resume:
                lag = first_resume[trigger_id] - due
                result.resume_lag.append(lag)
                if killed <= due <= back:
                    result.resume_lag_while_down.append(lag)
        arrivals.sort()
        inside = [t for t in arrivals if base <= t <= base + window]
        result.longest_event_gap_s = max(
            (b - a for a, b in itertools.pairwise(inside)), default=0.0
        )
        result.still_deferred = sum(
            1
            for key in per_task
            if (entry := scheduler.table.get(key)) is not None and entry.state == "deferred"
        )
    return result
