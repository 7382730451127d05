"""Where a lane's events are produced: trigger outcomes, cancels, failures, tombstones,
dead letters, each queued on the emitter, and their acks and failures.

Every record a lane writes goes out through :class:`EventSink`: the one place that builds
the sends of an event (the event on the resume topic, its copy on tasks.events, the
tombstone on the defer topic, a RunTask or a dead letter beside it).

Every event goes out twice, same bytes: on the trigger queue's resume topic keyed by
trigger id (the wire contract), and on tasks.events keyed by the task's ``ti_key``, in the
partition the tasks topic gives that key, where the scheduler owning the task reads it.
Both are sends of one emission, so the tombstone follows only once both are acked. Where no
deferline scheduler reads the prefix (``Settings.copy_events_to_tasks`` off, the Airflow
bridge's triggerers) there is no copy: the event goes out once. Where the partition writes
in transactions (its ``owner``, on Apache Kafka), the event, its copy and its tombstone
commit together: a reader in ``read_committed`` sees each exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deferline.engine import SourcePosition, TriggerOutcome
from deferline.schemas import (
    DeadLetter,
    DeferRequest,
    RunTask,
    TaskKey,
    TriggerEventRecord,
    WatchEvent,
    decode_as,
    encode,
    make_event_id,
    ti_key_of,
)
from deferline.topics import TopicNames, partition_for

from ._emitter import Emission, Emitter, Send
from ._events import EventEncoder, request_fields
from ._input import peek_identity
from ._lane_types import OwnedPartition, TriggerRef
from ._metrics import TriggererMetrics

logger = logging.getLogger(__name__)


_UNPRODUCIBLE = {"error": "event not producible"}


def _unproducible_id(trigger_id: str) -> str:
    return make_event_id(trigger_id, "failed", _UNPRODUCIBLE)


@dataclass(slots=True, eq=False)
class _EventInfo:
    """What the ack and failure callbacks of one queued event need to know."""

    trigger_id: str
    status: str
    event_id: str
    direct: bool
    value: bytes | None = None
    """The stored DeferRequest (hot path: decoded only if a log line or a failure needs it)."""
    task_key: TaskKey | None = None
    seq: int = 0

    def task(self) -> TaskKey | None:
        return self.task_key if self.task_key is not None else peek_identity(self.value)[1]

    def defer_seq(self) -> int:
        return peek_identity(self.value)[2] if self.value is not None else self.seq


@dataclass(slots=True, eq=False)
class _QueuedEvent:
    """One event in the emitter; its ack and failure callbacks (one small object each)."""

    sink: EventSink
    part: OwnedPartition
    key: bytes
    tombstone: bool
    info: _EventInfo

    def acked(self, metadata: Sequence[Any]) -> None:
        self.sink._acked(self, int(metadata[0].offset))

    def failed(self, error: BaseException) -> None:
        self.sink._failed(self, error)


@dataclass(slots=True, eq=False)
class _QueuedWatchEvent:
    """One watch event in the emitter, for its ack and failure callbacks."""

    sink: EventSink
    part: OwnedPartition
    key: bytes
    record: WatchEvent
    tombstone: bool

    def acked(self, metadata: Sequence[Any]) -> None:
        self.sink._watch_acked(self)

    def failed(self, error: BaseException) -> None:
        self.sink._watch_failed(self, error)


class EventSink:
    """Builds and queues a lane's records on the shared :class:`Emitter`."""

    def __init__(
        self,
        emitter: Emitter,
        *,
        names: TopicNames,
        queue: str | None,
        member: str,
        task_partitions: int | None,
        direct_resume: bool,
        metrics: TriggererMetrics,
        log: Callable[..., dict[str, Any]],
    ) -> None:
        """``task_partitions``: the partition count of tasks.events (that of ``tasks``); None:
        events are not copied there."""
        if task_partitions is not None and task_partitions < 1:
            raise ValueError(f"task_partitions must be at least 1, got {task_partitions}")
        self._emitter = emitter
        self._names = names
        self._queue = queue
        self._label = queue or "default"
        self._member = member
        self._defer_topic = names.defer(queue)
        self._resume_topic = names.resume(queue)
        self._task_events = names.task_events
        self._task_partitions = task_partitions
        self._direct_resume = direct_resume
        self._metrics = metrics
        self._log = log
        self._encoder = EventEncoder()
        self._counters: dict[str, Any] = {}

    def outcome(self, ref: TriggerRef, outcome: TriggerOutcome) -> None:
        """Queue a trigger's event (and, with direct resume, the task's RunTask)."""
        fields = request_fields(ref.value)
        direct = (
            self._direct_resume
            and fields.get("resume") is not None
            and outcome.status == "fired"
            and outcome.task_outcome is None
        )
        part = ref.part
        encoded = self._encoder.encode(
            fields,
            event_id=outcome.event_id,
            trigger_id=outcome.trigger_id,
            status=outcome.status,
            payload=outcome.payload,
            task_outcome=outcome.task_outcome,
            xcoms=outcome.xcoms,
            error=outcome.error,
            traceback=outcome.traceback,
            due_at=outcome.due_at,
            member=self._member,
            partition=part.number,
            queue=self._queue,
            resumed_directly=direct,
        )
        extra = (self._resume_directly(ref.value, outcome),) if direct else ()
        info = _EventInfo(outcome.trigger_id, outcome.status, outcome.event_id, direct, ref.value)
        task = fields["task"]
        ti_key = ti_key_of(
            task["dag_id"], task["task_id"], task["run_id"], task.get("map_index", -1)
        )
        self._submit(part, ref.key, encoded, info, ti_key=ti_key, extra=extra)

    def _resume_directly(self, value: bytes, outcome: TriggerOutcome) -> Send:
        request = decode_as(value, DeferRequest)
        target = request.resume
        assert target is not None
        run = RunTask(
            task=request.task,
            mode="resume",
            operator=target.operator,
            op_kwargs=target.op_kwargs,
            next_method=request.next_method,
            next_kwargs=request.next_kwargs,
            event=outcome.payload,
            event_id=outcome.event_id,
            trigger_id=request.trigger_id,
            defer_seq=request.defer_seq,
            worker_queue=target.worker_queue,
            pool=target.pool,
            pool_slots=target.pool_slots,
            priority_weight=target.priority_weight,
            retries=target.retries,
        )
        return Send(
            self._names.resumes(target.worker_queue), request.task.ti_key.encode(), encode(run)
        )

    def record(
        self,
        part: OwnedPartition,
        key: bytes,
        record: TriggerEventRecord,
        *,
        extra: Sequence[Send] = (),
        tombstone: bool = True,
    ) -> None:
        """Queue an event built as a record (cancels, bad input: the rare paths)."""
        info = _EventInfo(
            record.trigger_id,
            record.status,
            record.event_id,
            False,
            task_key=record.task,
            seq=record.defer_seq,
        )
        self._submit(
            part,
            key,
            encode(record),
            info,
            ti_key=record.task.ti_key,
            extra=extra,
            tombstone=tombstone,
        )

    def tombstone(self, part: OwnedPartition, key: bytes, event: bytes | None) -> None:
        """Queue the tombstone of ``key``, whose event is already on the resume topic, after
        that event (its bytes, ``event``) is sent again to tasks.events: an owner that died
        before the tombstone may also have died before the copy, and a copy the scheduler
        already has is dropped there as a duplicate. No copy when ``event`` names no task."""
        number = part.number
        task = peek_identity(event)[1]
        sends = () if task is None or event is None else self._task_sends(task.ti_key, event)
        if event is not None and task is None and self._task_partitions is not None:
            logger.warning(
                "event on the resume topic names no task: tombstone only, no tasks.events copy",
                extra=self._log(number, trigger_id=key.decode(errors="replace")),
            )
        self._emitter.submit(
            Emission(
                sends=sends,
                tombstone=Send(self._defer_topic, key, None, number),
                owner=part.owner,
                at=part.defer_tp,
            )
        )

    def watch_event(
        self,
        part: OwnedPartition,
        key: bytes,
        record: WatchEvent,
        *,
        tombstone: bool = False,
        letter: DeadLetter | None = None,
        source: SourcePosition | None = None,
    ) -> None:
        """Queue an event of a standing watch: on the resume topic only, no tasks.events copy
        (no task waits on it), and no tombstone unless the watch ends with it (``tombstone``:
        a ``once`` watch's last event, or a watch that cannot run, with its ``letter``);
        the offset of the record it was read from (``source``) committed with it."""
        queued = _QueuedWatchEvent(self, part, key, record, tombstone)
        dead = () if letter is None else (Send(self._names.dead, letter.key, encode(letter), None),)
        self._emitter.submit(
            Emission(
                sends=(Send(self._resume_topic, key, encode(record), part.number), *dead),
                tombstone=Send(self._defer_topic, key, None, part.number) if tombstone else None,
                on_acked=queued.acked,
                on_failed=queued.failed,
                owner=part.owner,
                at=part.defer_tp,
                source=source,
            )
        )

    def _watch_acked(self, queued: _QueuedWatchEvent) -> None:
        record = queued.record
        self._metrics.events.labels(queue=self._label, status=record.status).inc()
        logger.info(
            "watch event produced",
            extra=self._log(
                queued.part.number,
                trigger_id=record.trigger_id,
                status=record.status,
                event_id=record.event_id,
            ),
        )

    def _watch_failed(self, queued: _QueuedWatchEvent, error: BaseException) -> None:
        """A watch event that cannot be produced (too large, say): its failure instead,
        under the same id (the event itself never reached the topic)."""
        record = queued.record
        if record.payload is None and record.status == "failed":
            logger.error(
                "watch event not producible",
                extra=self._log(
                    queued.part.number, trigger_id=record.trigger_id, error=repr(error)
                ),
            )
            return
        replacement = record.model_copy(
            update={
                "status": "failed",
                "payload": None,
                "error": f"the watch's event could not be produced: {error!r}",
                "traceback": None,
            }
        )
        self.watch_event(queued.part, queued.key, replacement, tombstone=queued.tombstone)

    def _task_sends(self, ti_key: str, value: bytes) -> tuple[Send, ...]:
        """The copy of an event on tasks.events: key ``ti_key``, in its tasks partition; none
        when events are not copied."""
        if self._task_partitions is None:
            return ()
        key = ti_key.encode()
        return (Send(self._task_events, key, value, partition_for(key, self._task_partitions)),)

    def dead_letter(
        self,
        letter: DeadLetter,
        *,
        part: OwnedPartition,
        event: tuple[bytes, TriggerEventRecord] | None,
    ) -> None:
        """Queue a dead letter of a record of ``part``, with the failure event of its trigger
        when it names one (``event``: key, record), else with the tombstone of its key."""
        sends = (Send(self._names.dead, letter.key, encode(letter), None),)
        if event is not None:
            key, record = event
            # A keyless record has no table entry to delete: event and letter only.
            self.record(part, key, record, extra=sends, tombstone=letter.key is not None)
            return
        bad = letter.key
        tombstone = None if bad is None else Send(self._defer_topic, bad, None, part.number)
        self._emitter.submit(
            Emission(sends=sends, tombstone=tombstone, owner=part.owner, at=part.defer_tp)
        )

    def _submit(
        self,
        part: OwnedPartition,
        key: bytes,
        encoded: bytes,
        info: _EventInfo,
        *,
        ti_key: str,
        extra: Sequence[Send],
        tombstone: bool = True,
    ) -> None:
        number = part.number
        queued = _QueuedEvent(self, part, key, tombstone, info)
        self._emitter.submit(
            Emission(
                sends=(
                    Send(self._resume_topic, key, encoded, number),
                    *self._task_sends(ti_key, encoded),
                    *extra,
                ),
                tombstone=Send(self._defer_topic, key, None, number) if tombstone else None,
                on_acked=queued.acked,
                on_failed=queued.failed,
                owner=part.owner,
                at=part.defer_tp,
            )
        )

    def _acked(self, queued: _QueuedEvent, offset: int) -> None:
        info = queued.info
        if queued.part.book.owned:
            queued.part.table.note_event_offset(queued.key, offset)
        counter = self._counters.get(info.status)
        if counter is None:
            counter = self._metrics.events.labels(queue=self._label, status=info.status)
            self._counters[info.status] = counter
        counter.inc()
        if info.direct:
            self._metrics.direct_resumes.labels(queue=self._label).inc()
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "trigger event produced",
                extra=self._log(
                    queued.part.number,
                    trigger_id=info.trigger_id,
                    task=str(info.task()),
                    status=info.status,
                    event_id=info.event_id,
                ),
            )

    def _failed(self, queued: _QueuedEvent, error: BaseException) -> None:
        """The event itself cannot be produced (too large, say): tell the task why instead."""
        info = queued.info
        if info.status == "failed" and info.event_id == _unproducible_id(info.trigger_id):
            return
        task = info.task()
        number = queued.part.number
        if task is None:
            logger.error(
                "event not producible and its task unknown",
                extra=self._log(number, trigger_id=info.trigger_id, error=repr(error)),
            )
            return
        replacement = TriggerEventRecord(
            event_id=_unproducible_id(info.trigger_id),
            trigger_id=info.trigger_id,
            task=task,
            defer_seq=info.defer_seq(),
            status="failed",
            payload=_UNPRODUCIBLE,
            error=f"the trigger's event could not be produced: {error!r}",
            member=self._member,
            partition=number,
            queue=self._queue,
        )
        self.record(queued.part, queued.key, replacement, tombstone=queued.tombstone)
