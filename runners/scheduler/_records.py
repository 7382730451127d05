"""Scheduler records: reading the two input streams, routing decisions to their topics.

Decisions go out as records: TaskStateRecords to the tasks topic (key ``ti_key``), RunTasks
to ``queue[.<wq>]`` (new work) or ``queue[.<wq>].resumes`` (resumes, which workers read
first), CancelRequests to ``defer[.<queue>]``. For one task the state record is acknowledged
before its RunTask is sent (batch-wise; in one transaction on Apache Kafka, whose consumers
read committed records only), so a worker's "running" always lands after "queued".
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from aiokafka import TopicPartition
from deferline.engine import Emit, WrittenState
from deferline.schemas import (
    DeadLetter,
    EventFields,
    SchemaError,
    TaskStateRecord,
    TriggerEventRecord,
    decode,
    decode_event,
    encode,
)
from deferline.topics import TopicNames

from ..member import Outgoing

__all__ = [
    "ORPHAN_EVENT",
    "committable",
    "dead_letter",
    "orphan_letter",
    "read_as",
    "read_event",
    "waves",
]

ORPHAN_EVENT = "OrphanEvent"
"""The ``error_type`` of an event the scheduler could not place (see :func:`orphan_letter`)."""

R = TypeVar("R", TaskStateRecord, TriggerEventRecord)


def read_as(value: bytes, kind: type[R]) -> R:
    """Decode ``value`` as a ``kind`` record; SchemaError if unreadable or of another kind."""
    record = decode(value)
    if not isinstance(record, kind):
        raise _other_kind("task_state" if kind is TaskStateRecord else "trigger_event", record.kind)
    return record


def read_event(value: bytes) -> EventFields:
    """:func:`read_as` for a trigger event, read into its fields (without the model when it
    has the usual shape; the errors are the same)."""
    event = decode_event(value)
    if not isinstance(event, EventFields):
        raise _other_kind("trigger_event", event.kind)
    return event


def _other_kind(wanted: str, got: str) -> SchemaError:
    return SchemaError(f"expected {wanted}, got {got}", field="kind")


def dead_letter(message: Any, error: str, *, member: str) -> DeadLetter:
    """A DeadLetter of an unreadable input record."""
    return DeadLetter(
        topic=message.topic,
        partition=message.partition,
        offset=message.offset,
        key=message.key,
        value=message.value,
        error=error,
        error_type="SchemaError",
        member=member,
    )


def orphan_letter(event: EventFields, ref: Hashable | None, *, now: str, member: str) -> DeadLetter:
    """A DeadLetter of an event no deferral on the tasks topic matches, once the scheduler
    has read that topic to its end past the event; ``now`` says what the task is instead."""
    assert isinstance(ref, tuple), "the scheduler keeps (TopicPartition, offset) with an event"
    tp, offset = ref
    return DeadLetter(
        topic=tp.topic,
        partition=tp.partition,
        offset=offset,
        key=event.trigger_id.encode(),
        value=encode(event.full()),
        error=(
            f"no deferral on the tasks topic matches this event (try {event.task.try_number}, "
            f"deferral {event.defer_seq}, trigger {event.trigger_id}) after the scheduler read "
            f"that topic to its end; the task is {now}"
        ),
        error_type=ORPHAN_EVENT,
        member=member,
        trigger_id=event.trigger_id,
        task=event.task,
    )


def waves(
    names: TopicNames,
    out: Sequence[Emit],
    dead: Sequence[DeadLetter] = (),
    *,
    written: dict[bytes, WrittenState] | None = None,
) -> tuple[list[Outgoing], list[Outgoing], list[Outgoing]]:
    """CancelRequests, task states (and dead letters), RunTasks: in the order they must land.

    ``written`` gets each task state's encoded value mapped to the state as the table takes
    it back (:attr:`Emit.written`), so the scheduler can fold its own writes, when it reads
    them back, without decoding them.
    """
    cancels: list[Outgoing] = []
    states: list[Outgoing] = []
    runs: list[Outgoing] = []
    tasks = names.tasks
    run_topics: dict[tuple[str | None, bool], str] = {}  # names are formatted once a batch
    for emit in out:
        kind = emit.kind
        if kind == "task_state":
            value = emit.value()
            states.append((tasks, emit.key.encode(), value))
            if written is not None:
                written[value] = emit.written
        elif kind == "run_task":
            where = (emit.worker_queue, emit.resumes)
            topic = run_topics.get(where)
            if topic is None:
                worker_queue, resumes = where
                assert worker_queue is not None
                topic = names.resumes(worker_queue) if resumes else names.work(worker_queue)
                run_topics[where] = topic
            runs.append((topic, emit.key.encode(), emit.value()))
        elif kind == "cancel_request":
            cancels.append((names.defer(emit.queue), emit.key.encode(), emit.value()))
    for letter in dead:
        states.append((names.dead, None, encode(letter)))
    return cancels, states, runs


def committable(
    done: Mapping[TopicPartition, int],
    pending: Iterable[Hashable],
    committed: Mapping[TopicPartition, int],
) -> dict[TopicPartition, int]:
    """Per events partition: the offset after the last published event, but never past an
    event still held pending (so a new leader reads it again); only offsets that moved."""
    offsets = dict(done)
    for ref in pending:
        if isinstance(ref, tuple):
            tp, offset = ref
            if tp in offsets and offset < offsets[tp]:
                offsets[tp] = offset
    return {tp: offset for tp, offset in offsets.items() if offset > committed.get(tp, -1)}
