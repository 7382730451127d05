"""One record read back from a topic: where it lives, when, and what it says."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from deferline.schemas import (
    CancelRequest,
    DeadLetter,
    DeferRequest,
    PoolGrant,
    PoolWant,
    RunTask,
    SchemaError,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    TriggerLogRecord,
    WatchEvent,
    WatchRequest,
    decode,
)

from ._topics import TopicInfo, TopicRole

__all__ = ["REDRIVE_HEADER", "Position", "RawRecord", "ReplayRecord", "decode_raw"]

TopicRecord = (
    DeferRequest
    | CancelRequest
    | TriggerEventRecord
    | TaskStateRecord
    | RunTask
    | DeadLetter
    | WatchRequest
    | WatchEvent
)
"""The records of the topics replay reads (the pool ledger's are not among them)."""

REDRIVE_HEADER = "deferline-redrive"
"""Header set on a DeferRequest that `deferline replay redrive` re-published."""


@dataclass(frozen=True, slots=True)
class Position:
    """Where a record lives: topic, partition, offset and the broker timestamp."""

    topic: str
    partition: int
    offset: int
    timestamp: dt.datetime | None = None

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


@dataclass(frozen=True, slots=True)
class RawRecord:
    """Bytes as fetched, before decoding."""

    topic: TopicInfo
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class ReplayRecord:
    """A decoded record with its position; ``record`` is None for a tombstone or bad bytes."""

    position: Position
    role: TopicRole
    queue: str | None
    key: str | None
    record: TopicRecord | None
    error: str | None = None
    redriven: bool = False

    @property
    def tombstone(self) -> bool:
        return self.record is None and self.error is None

    @property
    def at(self) -> dt.datetime | None:
        """When the record says it happened (its own clock), else the broker timestamp."""
        rec = self.record
        if isinstance(rec, DeferRequest | CancelRequest | WatchRequest):
            return rec.requested_at
        if isinstance(rec, WatchEvent):
            return rec.emitted_at
        if isinstance(rec, TriggerEventRecord):
            landed = self.position.timestamp
            if self.role is TopicRole.TASK_EVENTS and landed is not None:
                return max(landed, rec.emitted_at)  # when the copy reached the task's partition
            return rec.emitted_at
        if isinstance(rec, TaskStateRecord):
            return rec.updated_at
        if isinstance(rec, RunTask):
            return rec.enqueued_at
        if isinstance(rec, DeadLetter):
            return rec.failed_at
        return self.position.timestamp

    @property
    def trigger_id(self) -> str | None:
        rec = self.record
        if rec is None:
            return self.key if self.role is TopicRole.DEFER else None
        if isinstance(rec, DeadLetter):
            if rec.trigger_id is None and rec.key is not None and _keyed_by_trigger(rec.topic):
                return rec.key.decode("utf-8", "replace")
            return rec.trigger_id
        return rec.trigger_id

    @property
    def task(self) -> TaskKey | None:
        """The task instance it is about; None for a standing watch's records (no task)."""
        rec = self.record
        if rec is None or isinstance(rec, WatchRequest | WatchEvent):
            return None
        return rec.task

    @property
    def kind(self) -> str:
        if self.record is not None:
            return self.record.kind
        return "tombstone" if self.error is None else "undecodable"

    def sort_key(self) -> tuple[float, int, float, str, int, int]:
        """Time order; records of one instant in the order the protocol writes them."""
        at = self.at
        ts = self.position.timestamp
        return (
            at.timestamp() if at else 0.0,
            self._rank(),
            ts.timestamp() if ts else 0.0,
            self.position.topic,
            self.position.partition,
            self.position.offset,
        )

    def _rank(self) -> int:
        rec = self.record
        if isinstance(rec, TaskStateRecord):
            return 0 if rec.state == "deferred" else 6
        if isinstance(rec, DeferRequest | WatchRequest):
            return 1
        if isinstance(rec, CancelRequest):
            return 2
        if isinstance(rec, DeadLetter):
            return 3
        if isinstance(rec, TriggerEventRecord | WatchEvent):
            return 4
        if isinstance(rec, RunTask):
            return 7
        return 5  # tombstone (after its event), undecodable


def _keyed_by_trigger(topic: str) -> bool:
    """Defer and resume topics (any prefix, any queue) are keyed by trigger id."""
    return any(part in ("defer", "resume") for part in topic.split("."))


def _ms_to_dt(ms: int | None) -> dt.datetime | None:
    if ms is None or ms < 0:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC)


def decode_raw(raw: RawRecord) -> ReplayRecord:
    """Decode fetched bytes; a record that does not decode keeps its error instead of failing."""
    position = Position(raw.topic.name, raw.partition, raw.offset, _ms_to_dt(raw.timestamp_ms))
    key = raw.key.decode("utf-8", "replace") if raw.key is not None else None
    redriven = any(name == REDRIVE_HEADER for name, _ in raw.headers)
    record: TopicRecord | None = None
    error: str | None = None
    if raw.value is not None:
        try:
            decoded = decode(raw.value)
        except SchemaError as exc:
            error = str(exc)
        else:
            if isinstance(decoded, PoolWant | PoolGrant | TriggerLogRecord):
                error = f"a {decoded.kind} record on a topic it does not belong to"
            else:
                record = decoded
    return ReplayRecord(
        position, raw.topic.role, raw.topic.queue, key, record, error=error, redriven=redriven
    )


def _short(text: str | None, limit: int = 120) -> str:
    if not text:
        return ""
    line = text.strip().splitlines()[-1] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def describe(rec: ReplayRecord) -> str:
    """One line saying what the record is, for timelines and evidence."""
    r = rec.record
    if r is None:
        if rec.error is not None:
            return f"undecodable record: {_short(rec.error)}"
        return "tombstone: trigger removed from the active table"
    if isinstance(r, DeferRequest):
        parts = [f"DeferRequest {r.classpath}", f"seq={r.defer_seq}"]
        if r.queue:
            parts.append(f"queue={r.queue}")
        if r.timeout_at:
            parts.append(f"timeout_at={r.timeout_at.isoformat()}")
        if r.kwargs_token:
            parts.append("kwargs=sealed")
        if rec.redriven:
            parts.append("(re-driven)")
        return " ".join(parts)
    if isinstance(r, CancelRequest):
        return f"CancelRequest reason={r.reason!r}"
    if isinstance(r, TriggerEventRecord):
        parts = [f"event {r.status}", f"id={r.event_id[:12]}"]
        if rec.role is TopicRole.TASK_EVENTS:
            parts.insert(0, "copy on the task's partition:")
        if r.member:
            parts.append(f"member={r.member}")
        if r.task_outcome:
            parts.append(f"outcome={r.task_outcome}")
        if r.error:
            parts.append(f"error={_short(r.error, 80)!r}")
        if r.resumed_directly:
            parts.append("resumed_directly")
        return " ".join(parts)
    if isinstance(r, TaskStateRecord):
        parts = [f"task {r.state}", f"try={r.task.try_number}", f"by={r.source}"]
        if r.trigger_id:
            parts.append(f"trigger={r.trigger_id}")
        if r.next_method:
            parts.append(f"next={r.next_method}")
        if r.event_id:
            parts.append(f"event={r.event_id[:12]}")
        if r.reason:
            parts.append(f"reason={_short(r.reason, 80)!r}")
        return " ".join(parts)
    if isinstance(r, WatchRequest | WatchEvent):
        return _describe_watch(r)
    if isinstance(r, RunTask):
        parts = [f"RunTask {r.mode}", f"worker_queue={r.worker_queue}", f"try={r.task.try_number}"]
        if r.next_method:
            parts.append(f"next={r.next_method}")
        if r.event_id:
            parts.append(f"event={r.event_id[:12]}")
        return " ".join(parts)
    parts = [f"DeadLetter {r.error_type}: {_short(r.error, 100)}", f"from={r.topic}[{r.partition}]"]
    if r.member:
        parts.append(f"member={r.member}")
    return " ".join(parts)


def _short_run(run: str) -> str:
    """A watch's run id cut to its first 8 characters (enough to tell runs apart)."""
    return run if len(run) <= 9 else run[:8] + "…"


def _describe_watch(r: WatchRequest | WatchEvent) -> str:
    """A standing watch's request, one of its events, or the failure of one of its runs."""
    if isinstance(r, WatchRequest):
        text = f"watch requested: {r.classpath}"
        if r.assets:
            text += f" (assets: {', '.join(asset.name for asset in r.assets)})"
        extras = [f"queue={r.queue}"] if r.queue else []
        if r.kwargs_token:
            extras.append("kwargs=sealed")
        return " ".join([text, *extras])
    where = [f"member {r.member}"] if r.member else []
    if r.partition is not None:
        where.append(f"partition {r.partition}")
    run = _short_run(r.run)
    if r.status == "failed":
        error = _short(r.error, 100) or "no error text"
        return f"watch run {run} failed: {error} ({', '.join([f'event {r.seq}', *where])})"
    return f"watch event {r.seq} of run {run} fired" + (f" ({', '.join(where)})" if where else "")
