"""Crafted topic histories: the records each party writes, in protocol order.

One builder serves the unit tests (records are given offsets in memory and folded) and the
integration tests (the same writes are produced to a real broker and read back).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from deferline.engine import TaskTable
from deferline.replay import RawRecord, ReplayRecord, classify_topic, decode_raw
from deferline.schemas import (
    AssetRef,
    CancelRequest,
    DeadLetter,
    DeferRequest,
    ResumeTarget,
    RunTask,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    WatchEvent,
    WatchRequest,
    encode,
    make_event_id,
    make_trigger_id,
    make_watch_event_id,
)
from deferline.topics import TopicNames, partition_for

# Recent, so that brokers keep the records (retention counts from record timestamps).
T0 = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(hours=2)
TIMER = "deferline.engine.triggers.DateTimeTrigger"
WATCHER = "pkg.triggers.InboxWatcher"


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


@dataclass(frozen=True, slots=True)
class Write:
    topic: str
    partition: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int = 0
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass
class History:
    """Records written by client, worker, triggerer and scheduler, in the order they write."""

    prefix: str = "deferline."
    partitions: int = 3
    writes: list[Write] = field(default_factory=list)
    folded: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def names(self) -> TopicNames:
        return TopicNames(self.prefix)

    # -- raw writes --------------------------------------------------------------------------

    def put(
        self,
        topic: str,
        key: str | None,
        record: Any | None,
        partition: int | None = None,
        *,
        when: dt.datetime | None = None,
    ) -> None:
        """Write ``record`` (None: a tombstone), stamped with its own time, else ``when``,
        else the previous write's."""
        key_bytes = key.encode() if key is not None else None
        if partition is None:
            partition = partition_for(key_bytes, self.partitions) if key_bytes else 0
        value = encode(record) if record is not None else None
        when = _record_time(record) or when
        stamp = int(when.timestamp() * 1000) if when else self._last_stamp()
        self.writes.append(Write(topic, partition, key_bytes, value, stamp))
        if isinstance(record, TaskStateRecord | TriggerEventRecord):
            self.folded.setdefault(record.task.ti_key, []).append(record)

    def _last_stamp(self) -> int:
        return self.writes[-1].timestamp_ms if self.writes else int(T0.timestamp() * 1000)

    # -- the parties ------------------------------------------------------------------------

    def submit(self, task: TaskKey, when: float, *, worker_queue: str = "default") -> None:
        target = ResumeTarget(operator="pkg.ops.Wait", worker_queue=worker_queue)
        state = TaskStateRecord(
            task=task, state="scheduled", source="client", resume=target, updated_at=at(when)
        )
        self.put(self.names.tasks, task.ti_key, state)

    def start(self, task: TaskKey, when: float, *, worker_queue: str = "default") -> None:
        target = ResumeTarget(operator="pkg.ops.Wait", worker_queue=worker_queue)
        queued = TaskStateRecord(
            task=task, state="queued", source="scheduler", resume=target, updated_at=at(when)
        )
        self.put(self.names.tasks, task.ti_key, queued)
        run = RunTask(
            task=task,
            mode="start",
            operator=target.operator,
            worker_queue=worker_queue,
            enqueued_at=at(when),
        )
        self.put(self.names.work(worker_queue), task.ti_key, run)
        running = TaskStateRecord(
            task=task, state="running", source="worker", updated_at=at(when + 0.1)
        )
        self.put(self.names.tasks, task.ti_key, running)

    def defer(
        self,
        task: TaskKey,
        when: float,
        *,
        seq: int = 0,
        queue: str | None = None,
        classpath: str = TIMER,
        kwargs: dict[str, Any] | None = None,
        timeout_at: dt.datetime | None = None,
        publish: bool = True,
        worker_queue: str = "default",
    ) -> DeferRequest:
        """The worker: "deferred" first, then the DeferRequest (unless ``publish=False``)."""
        trigger_id = make_trigger_id(task, seq)
        target = ResumeTarget(operator="pkg.ops.Wait", worker_queue=worker_queue)
        state = TaskStateRecord(
            task=task,
            state="deferred",
            source="worker",
            trigger_id=trigger_id,
            defer_seq=seq,
            next_method="execute_complete",
            updated_at=at(when),
            queue=queue,
            resume=target,
            timeout_at=timeout_at,
        )
        self.put(self.names.tasks, task.ti_key, state)
        request = DeferRequest(
            trigger_id=trigger_id,
            task=task,
            defer_seq=seq,
            classpath=classpath,
            kwargs=kwargs if kwargs is not None else {"moment": at(when + 60)},
            timeout_at=timeout_at,
            queue=queue,
            requested_at=at(when + 0.01),
            resume=target,
        )
        if publish:
            self.put(self.names.defer(queue), trigger_id, request)
        return request

    def emit(
        self,
        request: DeferRequest,
        when: float,
        *,
        status: str = "fired",
        member: str = "triggerer-a",
        payload: Any = None,
        error: str | None = None,
        traceback: str | None = None,
        tombstone: bool = True,
        copied: bool = True,
        resumed_directly: bool = False,
    ) -> TriggerEventRecord:
        """The triggerer: the event on the resume topic and its copy on tasks.events (unless
        not ``copied``), then the tombstone."""
        payload = payload if payload is not None else {"at": at(when).isoformat()}
        partition = partition_for(request.trigger_id.encode(), self.partitions)
        event = TriggerEventRecord(
            event_id=make_event_id(request.trigger_id, status, payload),
            trigger_id=request.trigger_id,
            task=request.task,
            defer_seq=request.defer_seq,
            status=status,
            payload=payload,
            error=error,
            traceback=traceback,
            emitted_at=at(when),
            member=member,
            partition=partition,
            queue=request.queue,
            resumed_directly=resumed_directly,
        )
        self.put(self.names.resume(request.queue), request.trigger_id, event)
        if copied:
            self.put(self.names.task_events, request.task.ti_key, event)
        if tombstone:
            self.put(self.names.defer(request.queue), request.trigger_id, None)
        return event

    def dead_letter(
        self,
        request: DeferRequest,
        when: float,
        *,
        error_type: str,
        error: str,
        member: str = "triggerer-a",
    ) -> None:
        """The triggerer: a bad request is dead-lettered, failed and tombstoned."""
        topic = self.names.defer(request.queue)
        partition = partition_for(request.trigger_id.encode(), self.partitions)
        offset = sum(1 for w in self.writes if w.topic == topic and w.partition == partition) - 1
        letter = DeadLetter(
            topic=topic,
            partition=partition,
            offset=offset,
            key=request.trigger_id.encode(),
            value=encode(request),
            error=error,
            error_type=error_type,
            member=member,
            failed_at=at(when),
            trigger_id=request.trigger_id,
            task=request.task,
        )
        self.put(self.names.dead, request.trigger_id, letter)
        text = f"{error_type}: {error}"
        self.emit(
            request, when, status="failed", member=member, payload={"error": text}, error=text
        )

    def cancel(self, request: DeferRequest, when: float) -> None:
        cancel = CancelRequest(
            trigger_id=request.trigger_id,
            task=request.task,
            defer_seq=request.defer_seq,
            reason="cleared",
            requested_at=at(when),
        )
        self.put(self.names.defer(request.queue), request.trigger_id, cancel)

    def watch(
        self,
        trigger_id: str,
        when: float,
        *,
        classpath: str = WATCHER,
        assets: tuple[str, ...] = ("inbox",),
        queue: str | None = None,
    ) -> WatchRequest:
        """Whoever keeps a standing watch (the Airflow bridge): its WatchRequest."""
        request = WatchRequest(
            trigger_id=trigger_id,
            classpath=classpath,
            kwargs={"path": "/data/inbox"},
            queue=queue,
            assets=[AssetRef(name=name, uri=f"file:///data/{name}") for name in assets],
            requested_at=at(when),
        )
        self.put(self.names.defer(queue), trigger_id, request)
        return request

    def watch_event(
        self,
        request: WatchRequest,
        when: float,
        *,
        run: str,
        seq: int,
        status: str = "fired",
        member: str = "triggerer-a",
        error: str | None = None,
        traceback: str | None = None,
    ) -> WatchEvent:
        """The triggerer: one event of a watch's run (or its failure), on the resume topic only
        (no copy on tasks.events, no tombstone)."""
        failed = status == "failed"
        event = WatchEvent(
            event_id=make_watch_event_id(request.trigger_id, run, seq),
            trigger_id=request.trigger_id,
            run=run,
            seq=seq,
            status=status,
            payload=None if failed else {"n": seq},
            error=error,
            traceback=traceback,
            emitted_at=at(when),
            member=member,
            partition=partition_for(request.trigger_id.encode(), self.partitions),
            queue=request.queue,
        )
        self.put(self.names.resume(request.queue), request.trigger_id, event)
        return event

    def unwatch(self, request: WatchRequest, when: float) -> None:
        """Whoever keeps the watch ends it: the tombstone of its WatchRequest."""
        self.put(self.names.defer(request.queue), request.trigger_id, None, when=at(when))

    def schedule(self, event: TriggerEventRecord) -> None:
        """The scheduler applies ``event``: fold the task's earlier records with the engine's
        table, then write exactly what applying the event emits."""
        table = TaskTable()
        for record in self.folded.get(event.task.ti_key, []):
            if record is not event:
                table.apply(record)
        table.drain()
        table.apply(event)
        for emit in table.drain():
            rec = emit.record
            if isinstance(rec, TaskStateRecord):
                self.put(self.names.tasks, rec.task.ti_key, rec)
            elif isinstance(rec, RunTask):
                topic = (
                    self.names.resumes(rec.worker_queue)
                    if rec.mode == "resume"
                    else self.names.work(rec.worker_queue)
                )
                self.put(topic, rec.task.ti_key, rec)

    def worker_state(self, task: TaskKey, state: str, when: float) -> None:
        record = TaskStateRecord(
            task=task,
            state=state,
            source="worker",
            updated_at=at(when),
        )
        self.put(self.names.tasks, task.ti_key, record)

    # -- reading back in memory --------------------------------------------------------------

    def records(self) -> list[ReplayRecord]:
        """The writes as a replay reads them, with offsets per partition."""
        return [decode_raw(raw) for raw in self.raw_records()]

    def raw_records(self) -> list[RawRecord]:
        """The writes as fetched, before decoding, with offsets per partition."""
        offsets: dict[tuple[str, int], int] = {}
        out = []
        for write in self.writes:
            info = classify_topic(write.topic, prefix=self.prefix)
            assert info is not None, write.topic
            offset = offsets.get((write.topic, write.partition), 0)
            offsets[(write.topic, write.partition)] = offset + 1
            raw = RawRecord(
                info,
                write.partition,
                offset,
                write.timestamp_ms,
                write.key,
                write.value,
                write.headers,
            )
            out.append(raw)
        return out


def _record_time(record: Any) -> dt.datetime | None:
    for name in ("requested_at", "emitted_at", "updated_at", "enqueued_at", "failed_at"):
        value = getattr(record, name, None)
        if isinstance(value, dt.datetime):
            return value
    return None


def task_key(
    name: str = "t1", *, dag: str = "dag", run: str = "run1", try_number: int = 1
) -> TaskKey:
    return TaskKey(dag_id=dag, task_id=name, run_id=run, try_number=try_number)
