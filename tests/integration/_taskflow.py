"""Test helper: write task records and read back what the scheduler, workers and triggerers
publish (tasks topic, worker queues, defer topics) on a real broker."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import TopicPartition
from deferline.schemas import (
    CancelRequest,
    ResumeTarget,
    RunTask,
    SchemaError,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    decode,
    encode,
    make_event_id,
    make_trigger_id,
    utcnow,
)
from deferline.topics import (
    Settings,
    TopicNames,
    ensure_topics,
    make_consumer,
    make_producer,
    stop_client,
    topic_specs,
)

from tests._until import describe, until


def task_key(name: str, try_number: int = 1) -> TaskKey:
    return TaskKey(dag_id="dag", task_id=name, run_id="run1", try_number=try_number)


class TaskFlow:
    """Producer plus a reader of every topic the scheduler writes, for one test."""

    def __init__(
        self, settings: Settings, *, worker_queues: Sequence[str] = (), queues: Sequence[str] = ()
    ) -> None:
        self.settings = settings
        self.names = TopicNames(settings.topic_prefix)
        self.worker_queues = ("default", *worker_queues)
        self.queues: tuple[str | None, ...] = (None, *queues)
        self.tasks_log: list[TaskStateRecord] = []
        self.runs: list[tuple[str, RunTask]] = []  # (topic, run)
        self.cancels: list[CancelRequest] = []
        self.events: list[TriggerEventRecord] = []
        self._changed = asyncio.Event()
        self._producer: Any = None
        self._consumer: Any = None
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> TaskFlow:
        await ensure_topics(
            self.settings,
            topic_specs(
                self.settings,
                queues=[q for q in self.queues if q],
                worker_queues=self.worker_queues,
            ),
        )
        self._producer = make_producer(self.settings)
        await self._producer.start()
        topics = [self.names.tasks]
        for wq in self.worker_queues:
            topics += [self.names.work(wq), self.names.resumes(wq)]
        for q in self.queues:
            topics += [self.names.defer(q), self.names.resume(q)]
        self._consumer = make_consumer(self.settings, group_id=None, fetch_max_wait_ms=10)
        await self._consumer.start()
        tps = []
        for topic in topics:
            for _ in range(100):
                parts = self._consumer.partitions_for_topic(topic)
                if parts:
                    break
                await self._consumer._client.force_metadata_update()
            tps += [TopicPartition(topic, p) for p in sorted(parts or ())]
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
                for message in messages:
                    if message.value is None:
                        continue
                    try:
                        record = decode(message.value)
                    except SchemaError:
                        continue  # a test's deliberately unreadable record
                    if isinstance(record, TaskStateRecord):
                        self.tasks_log.append(record)
                    elif isinstance(record, RunTask):
                        self.runs.append((tp.topic, record))
                    elif isinstance(record, CancelRequest):
                        self.cancels.append(record)
                    elif isinstance(record, TriggerEventRecord):
                        self.events.append(record)
            if batches:
                self._changed.set()

    # -- reading ----------------------------------------------------------------------------

    def latest(self, task: TaskKey) -> TaskStateRecord | None:
        """The last record on the tasks topic for this task instance."""
        for record in reversed(self.tasks_log):
            if record.task.ti_key == task.ti_key:
                return record
        return None

    def runs_of(self, task: TaskKey, mode: str | None = None) -> list[RunTask]:
        return [
            run
            for _, run in self.runs
            if run.task.ti_key == task.ti_key and (mode is None or run.mode == mode)
        ]

    def summary(self) -> str:
        """What the reader has seen: each task's last state, the RunTasks per mode, and the
        high watermarks it last heard of on the tasks and work topics (a failed wait says
        it: is the writer or the reader behind?)."""
        states = {record.task.ti_key: record.state for record in self.tasks_log}
        modes: dict[str, int] = {}
        for _, run in self.runs:
            modes[run.mode] = modes.get(run.mode, 0) + 1
        ends = {
            f"{tp.topic}[{tp.partition}]": self._consumer.highwater(tp)
            for tp in sorted(self._consumer.assignment())
            if tp.topic in (self.names.tasks, self.names.work())
        }
        reader = self._reader
        failed = reader is not None and reader.done() and not reader.cancelled()
        return (
            f"{len(self.tasks_log)} task records, last states {states}; RunTasks {modes}; "
            f"{len(self.events)} events; high watermarks {ends}; "
            f"reader {repr(reader.exception()) if failed and reader else 'running'}"
        )

    async def wait_for(self, predicate: Callable[[], Any], within: float = 20.0) -> Any:
        """Wait until ``predicate()`` is truthy (re-checked whenever records arrive, and every
        0.5 s); on timeout, the failure says what was read so far."""
        return await until(
            predicate,
            within=within,
            interval=0.5,
            what=lambda: f"{describe(predicate)}; read so far: {self.summary()}",
            wake=self._changed,
        )

    async def wait_state(
        self, task: TaskKey, *states: str, within: float = 20.0
    ) -> TaskStateRecord:
        def check() -> TaskStateRecord | None:
            latest = self.latest(task)
            return latest if latest is not None and latest.state in states else None

        result: TaskStateRecord = await self.wait_for(check, within)
        return result

    async def wait_passed(self, task: TaskKey, state: str, within: float = 20.0) -> TaskStateRecord:
        """The first record of ``task`` in ``state``, once read, whatever came after it (a
        short trigger's task may be deferred and resumed between two reads)."""

        def check() -> TaskStateRecord | None:
            return next(
                (r for r in self.tasks_log if r.task.ti_key == task.ti_key and r.state == state),
                None,
            )

        result: TaskStateRecord = await self.wait_for(check, within)
        return result

    # -- writing ----------------------------------------------------------------------------

    async def put(self, topic: str, key: str, record: Any) -> None:
        await self.put_bytes(topic, key, encode(record))

    async def put_bytes(self, topic: str, key: str, value: bytes) -> None:
        await self._producer.send_and_wait(topic, value, key=key.encode())

    async def submit(self, task: TaskKey, operator: str = "pkg.Op", **target: Any) -> None:
        record = TaskStateRecord(
            task=task,
            state="scheduled",
            source="client",
            resume=ResumeTarget(operator=operator, **target),
        )
        await self.put(self.names.tasks, task.ti_key, record)

    async def worker_state(self, task: TaskKey, state: Any, **fields: Any) -> TaskStateRecord:
        record = TaskStateRecord(task=task, state=state, source="worker", **fields)
        await self.put(self.names.tasks, task.ti_key, record)
        return record

    async def defer(self, task: TaskKey, seq: int = 0, **fields: Any) -> TaskStateRecord:
        values: dict[str, Any] = {
            "trigger_id": make_trigger_id(task, seq),
            "defer_seq": seq,
            "next_method": "execute_complete",
            "next_kwargs": {"seq": seq},
            "timeout_at": utcnow() + dt.timedelta(hours=1),
        }
        values.update(fields)
        return await self.worker_state(task, "deferred", **values)

    async def fire(
        self,
        task: TaskKey,
        seq: int = 0,
        status: Any = "fired",
        *,
        queue: str | None = None,
        **fields: Any,
    ) -> TriggerEventRecord:
        trigger_id = make_trigger_id(task, seq)
        payload = fields.pop("payload", {"seq": seq})
        record = TriggerEventRecord(
            event_id=make_event_id(trigger_id, status, payload),
            trigger_id=trigger_id,
            task=task,
            defer_seq=seq,
            status=status,
            payload=payload,
            queue=queue,
            **fields,
        )
        # As a triggerer does: on the trigger queue's resume topic (key: trigger id) and on
        # tasks.events (key: the task's ti_key), which the scheduler reads.
        await self.put(self.names.resume(queue), trigger_id, record)
        await self.put(self.names.task_events, task.ti_key, record)
        return record
