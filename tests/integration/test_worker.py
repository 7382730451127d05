"""The worker on a real broker: deferral records, resume, __fail__, dedup, priority, retries."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import TopicPartition
from deferline.engine import BaseOperator, Context
from deferline.engine.triggers import TimeDeltaTrigger
from deferline.runners.worker import Worker
from deferline.schemas import (
    DeferRequest,
    RunTask,
    TaskKey,
    TaskStateRecord,
    decode,
    encode,
    make_trigger_id,
)
from deferline.topics import (
    Settings,
    TopicNames,
    ensure_topics,
    make_consumer,
    make_producer,
    partition_for,
    stop_client,
    topic_specs,
)

from tests._until import until

pytestmark = pytest.mark.integration

HERE = __name__  # operators below are loaded by the worker from this module's classpath
CALLS: list[dict[str, Any]] = []
_LOCK = threading.Lock()


def _record(**entry: Any) -> None:
    with _LOCK:
        CALLS.append(entry)


class DeferringOperator(BaseOperator):
    def __init__(self, *, label: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.label = label

    def execute(self, context: Context) -> Any:
        _record(label=self.label, method="execute", try_number=context["try_number"])
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(hours=1)),
            method_name="finish",
            kwargs={"carried": self.label},
        )

    def finish(self, context: Context, event: Any = None, *, carried: str) -> Any:
        _record(label=self.label, method="finish", event=event, carried=carried)
        return event


class Quick(BaseOperator):
    def __init__(self, *, label: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.label = label

    def execute(self, context: Context) -> Any:
        _record(label=self.label, method="execute", try_number=context["try_number"])


class Gate(BaseOperator):
    """Blocks its slot until the test opens the gate."""

    opened = threading.Event()
    entered = threading.Event()

    def execute(self, context: Context) -> Any:
        type(self).entered.set()
        if not type(self).opened.wait(30):
            raise TimeoutError("gate never opened")
        _record(label="gate", method="execute")


class Flaky(BaseOperator):
    def execute(self, context: Context) -> Any:
        _record(label="flaky", method="execute", try_number=context["try_number"])
        if context["try_number"] < 2:
            raise RuntimeError("first try fails")
        return "ok"


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    CALLS.clear()
    Gate.opened.clear()
    Gate.entered.clear()
    yield
    Gate.opened.set()


@dataclass
class Seen:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    record: Any


class TopicLog:
    """Reads the tasks, defer and worker topics from the start; produces RunTasks."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.names = TopicNames(settings.topic_prefix)
        self.seen: list[Seen] = []
        self._producer = make_producer(settings)
        self._consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=10)
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> TopicLog:
        await ensure_topics(self.settings, topic_specs(self.settings))
        await self._producer.start()
        await self._consumer.start()
        tps = [
            TopicPartition(topic, p)
            for topic in (self.names.tasks, self.names.defer())
            for p in range(self.settings.partitions)
        ]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        # aiokafka can let a cancelled fetch's CancelledError out of stop() before it closes
        # its connections; stop_client always closes them.
        await stop_client(self._consumer, grace=10.0, name="test consumer")
        await stop_client(self._producer, grace=10.0, name="test producer")

    async def _read(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            for tp, messages in batches.items():
                for m in messages:
                    record = decode(m.value) if m.value is not None else None
                    self.seen.append(Seen(tp.topic, tp.partition, m.offset, m.key, record))

    def states(self, task: TaskKey) -> list[str]:
        return [
            s.record.state
            for s in self.seen
            if isinstance(s.record, TaskStateRecord) and s.record.task.ti_key == task.ti_key
        ]

    def requests(self) -> list[Seen]:
        return [s for s in self.seen if isinstance(s.record, DeferRequest)]

    async def send(self, run: RunTask) -> None:
        topic = self.names.work() if run.mode == "start" else self.names.resumes()
        await self._producer.send_and_wait(topic, encode(run), key=run.task.ti_key.encode())


@pytest.fixture
def worker_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"allowed_operator_prefixes": [HERE]})


@pytest.fixture
async def log(worker_settings: Settings) -> AsyncIterator[TopicLog]:
    async with TopicLog(worker_settings) as topic_log:
        yield topic_log


def fast_worker(settings: Settings, **kwargs: Any) -> Worker:
    """A worker that joins its group quickly (a short session timeout speeds Tansu's join)."""
    return Worker(settings, session_timeout_ms=6_000, heartbeat_interval_ms=500, **kwargs)


def key(name: str, try_number: int = 1) -> TaskKey:
    return TaskKey(dag_id="dag", task_id=name, run_id="run", try_number=try_number)


def start(name: str, operator: str, *, try_number: int = 1, retries: int = 0, **kw: Any) -> RunTask:
    return RunTask(
        task=key(name, try_number),
        mode="start",
        operator=f"{HERE}.{operator}",
        op_kwargs=kw,
        retries=retries,
    )


def resume(request: DeferRequest, *, event: Any, **changes: Any) -> RunTask:
    assert request.resume is not None
    fields: dict[str, Any] = {
        "task": request.task,
        "mode": "resume",
        "operator": request.resume.operator,
        "op_kwargs": request.resume.op_kwargs,
        "next_method": request.next_method,
        "next_kwargs": request.next_kwargs,
        "event": event,
        "event_id": f"e-{request.trigger_id}",
        "trigger_id": request.trigger_id,
        "defer_seq": request.defer_seq,
    }
    fields.update(changes)
    return RunTask(**fields)


async def test_defer_writes_deferred_state_and_keyed_request(
    worker_settings: Settings, log: TopicLog
) -> None:
    task = key("a")
    async with fast_worker(worker_settings, slots=2) as worker:
        await log.send(start("a", "DeferringOperator", label="a"))
        await until(lambda: log.requests(), within=20, interval=0.05, what="DeferRequest published")
        await until(lambda: worker.metrics.deferred == 1, within=5, interval=0.05)
    seen = log.requests()[0]
    request = seen.record
    trigger_id = make_trigger_id(task, 0)
    assert request.trigger_id == trigger_id
    assert seen.key == trigger_id.encode()
    assert seen.partition == partition_for(trigger_id.encode(), worker_settings.partitions)
    assert request.next_method == "finish"
    assert request.next_kwargs == {"carried": "a"}
    assert request.resume is not None
    assert request.resume.operator == f"{HERE}.DeferringOperator"
    assert log.states(task)[:2] == ["running", "deferred"]
    deferred = next(
        s.record
        for s in log.seen
        if isinstance(s.record, TaskStateRecord) and s.record.state == "deferred"
    )
    assert deferred.trigger_id == trigger_id
    assert worker.metrics.slot_seconds > 0


async def test_resume_runs_next_method_with_event_and_fail_fails(
    worker_settings: Settings, log: TopicLog
) -> None:
    async with fast_worker(worker_settings, slots=2):
        await log.send(start("ok", "DeferringOperator", label="ok"))
        await log.send(start("bad", "DeferringOperator", label="bad"))
        await until(lambda: len(log.requests()) == 2, within=20, interval=0.05)
        by_task = {s.record.task.task_id: s.record for s in log.requests()}
        await log.send(resume(by_task["ok"], event={"status": "done", "n": 7}))
        await log.send(
            resume(
                by_task["bad"],
                event=None,
                next_method="__fail__",
                next_kwargs={"error": "Trigger failure: boom", "status": "failed"},
            )
        )
        await until(lambda: "success" in log.states(key("ok")), within=20, interval=0.05)
        await until(lambda: "failed" in log.states(key("bad")), within=20, interval=0.05)
    finish = [c for c in CALLS if c["method"] == "finish"]
    assert finish == [
        {"label": "ok", "method": "finish", "event": {"status": "done", "n": 7}, "carried": "ok"}
    ]
    failed = [
        s.record
        for s in log.seen
        if isinstance(s.record, TaskStateRecord) and s.record.state == "failed"
    ]
    assert failed[0].reason == "TaskDeferralError: Trigger failure: boom"


async def test_duplicate_runtasks_are_ignored_even_after_a_restart(
    worker_settings: Settings, log: TopicLog
) -> None:
    async with fast_worker(worker_settings, slots=2) as worker:
        await log.send(start("d", "DeferringOperator", label="d"))
        await until(lambda: log.requests(), within=20, interval=0.05)
        request = log.requests()[0].record
        again = resume(request, event="fired")
        await log.send(again)
        await log.send(again)  # e.g. direct resume and the scheduler both sent it
        await until(lambda: "success" in log.states(key("d")), within=20, interval=0.05)
        await until(lambda: worker.metrics.duplicates == 1, within=10, interval=0.05)
    # A fresh worker in a new group replays the whole queue (start, resume, resume): it
    # learns from the tasks topic alone that the task moved past all three.
    async with fast_worker(worker_settings, slots=2, group_id="replayer") as fresh:
        await until(lambda: fresh.metrics.duplicates == 3, within=20, interval=0.05)
        assert fresh.metrics.started == fresh.metrics.resumed == 0
    assert [c["method"] for c in CALLS] == ["execute", "finish"]
    assert log.states(key("d")).count("success") == 1


async def test_resumes_go_ahead_of_a_backlog_of_new_work(
    worker_settings: Settings, log: TopicLog
) -> None:
    async with fast_worker(worker_settings, slots=1) as worker:
        await log.send(start("r", "DeferringOperator", label="r"))
        await until(lambda: log.requests(), within=20, interval=0.05)
        request = log.requests()[0].record
        await log.send(start("gate", "Gate"))
        await until(
            Gate.entered.is_set, within=20, interval=0.05, what="gate task holds the only slot"
        )
        for i in range(10):
            await log.send(start(f"new{i}", "Quick", label=f"new{i}"))
        await log.send(resume(request, event="go"))
        resumes = TopicNames(worker_settings.topic_prefix).resumes()

        async def resume_seen() -> bool:
            return (await worker.backlog())[resumes] > 0

        await until(
            resume_seen, within=20, interval=0.05, what="worker has seen the waiting resume"
        )
        Gate.opened.set()
        await until(lambda: len(CALLS) >= 13, within=30, interval=0.05, what="all tasks ran")
    order = [c["label"] for c in CALLS]
    assert order[:3] == ["r", "gate", "r"], order
    assert sorted(order[3:]) == sorted(f"new{i}" for i in range(10))


async def test_retries_then_success(worker_settings: Settings, log: TopicLog) -> None:
    async with fast_worker(worker_settings, slots=1):
        await log.send(start("f", "Flaky", retries=1))
        await until(lambda: "up_for_retry" in log.states(key("f")), within=20, interval=0.05)
        # the scheduler would now schedule try 2; do what it would send
        await log.send(start("f", "Flaky", try_number=2, retries=1))
        await until(lambda: "success" in log.states(key("f")), within=20, interval=0.05)
    assert [c["try_number"] for c in CALLS] == [1, 2]
    up = next(
        s.record
        for s in log.seen
        if isinstance(s.record, TaskStateRecord) and s.record.state == "up_for_retry"
    )
    assert up.task.try_number == 1
    assert "first try fails" in (up.reason or "")


async def test_unreadable_runtask_is_dead_lettered_and_work_goes_on(
    worker_settings: Settings, log: TopicLog
) -> None:
    names = TopicNames(worker_settings.topic_prefix)
    producer = make_producer(worker_settings)
    await producer.start()
    try:
        await producer.send_and_wait(names.work(), b'{"kind": "run_task"}', key=b"junk")
    finally:
        await producer.stop()
    async with fast_worker(worker_settings, slots=1):
        await log.send(start("after", "Quick", label="after"))
        await until(lambda: "success" in log.states(key("after")), within=20, interval=0.05)
    dead = make_consumer(worker_settings, group_id=None)
    await dead.start()
    try:
        tps = [TopicPartition(names.dead, p) for p in range(worker_settings.partitions)]
        dead.assign(tps)
        await dead.seek_to_beginning(*tps)
        letters: list[Any] = []

        async def got_letter() -> bool:
            for records in (await dead.getmany(timeout_ms=100)).values():
                letters.extend(decode(r.value) for r in records if r.value is not None)
            return bool(letters)

        await until(got_letter, within=20, interval=0.05)
    finally:
        await dead.stop()
    assert letters[0].topic == names.work()
    assert letters[0].key == b"junk"
    assert letters[0].value == b'{"kind": "run_task"}'


async def _committed(settings: Settings, group_id: str, topic: str) -> int:
    """Sum of committed offsets of ``group_id`` over the partitions of ``topic``."""
    consumer = make_consumer(settings, group_id=group_id)
    await consumer.start()
    try:
        total = 0
        for p in range(settings.partitions):
            total += await consumer.committed(TopicPartition(topic, p)) or 0
        return total
    finally:
        await consumer.stop()


async def test_stop_lets_a_running_operator_finish_and_commits_it(
    worker_settings: Settings, log: TopicLog
) -> None:
    worker = fast_worker(worker_settings, slots=1, graceful_timeout=30)
    await worker.start()
    try:
        await log.send(start("g", "Gate"))
        await until(Gate.entered.is_set, within=20, interval=0.05)
        stopping = asyncio.create_task(worker.stop())
        await asyncio.sleep(0)
        assert not stopping.done()  # waits for the operator, which still holds its slot
        Gate.opened.set()
        await asyncio.wait_for(stopping, 20)
    finally:
        await worker.stop()
    await until(lambda: "success" in log.states(key("g")), within=10, interval=0.05)
    names = TopicNames(worker_settings.topic_prefix)
    assert await _committed(worker_settings, worker.group_id, names.work()) == 1


async def test_graceful_timeout_abandons_the_run_uncommitted(
    worker_settings: Settings, log: TopicLog
) -> None:
    worker = fast_worker(worker_settings, slots=1, graceful_timeout=0.2)
    await worker.start()
    try:
        await log.send(start("g", "Gate"))
        await until(Gate.entered.is_set, within=20, interval=0.05)
    finally:
        await asyncio.wait_for(worker.stop(), 20)
    Gate.opened.set()  # let the abandoned thread end while the loop still runs
    await until(lambda: any(c["label"] == "gate" for c in CALLS), within=10, interval=0.05)
    names = TopicNames(worker_settings.topic_prefix)
    assert await _committed(worker_settings, worker.group_id, names.work()) == 0
    assert log.states(key("g")) == ["running"]  # redelivered later, and run again
