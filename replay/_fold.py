"""The pure fold: records in, per-trigger and per-task histories out (no I/O, no clock)."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass, field

import orjson
from deferline.schemas import (
    CancelRequest,
    DeadLetter,
    DeferRequest,
    RunTask,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    WatchEvent,
    WatchRequest,
)

from ._records import ReplayRecord
from ._topics import TopicRole, classify_topic

__all__ = [
    "OwnerGuess",
    "OwnershipLog",
    "ReplayIndex",
    "TaskHistory",
    "TriggerHistory",
    "WatchTally",
]

KEEP = 200
"""Records kept per list of one trigger or task; beyond it the middle ones are counted, not kept."""


class _Kept(list[ReplayRecord]):
    """A list that keeps its first and latest records and counts the ones it let go."""

    dropped: int = 0

    def keep(self, rec: ReplayRecord) -> None:
        self.append(rec)
        if len(self) > KEEP:
            del self[KEEP // 2]
            self.dropped += 1

    def ordered(self) -> list[ReplayRecord]:
        return sorted(self, key=ReplayRecord.sort_key)


def _norm(queue: str | None) -> str | None:
    """The default trigger queue is named both ``None`` and ``"default"``."""
    return None if queue in (None, "default") else queue


def _later(a: ReplayRecord, b: ReplayRecord) -> bool:
    """Is ``a`` after ``b``? Offsets decide within one partition, clocks across partitions."""
    pa, pb = a.position, b.position
    if pa.topic == pb.topic and pa.partition == pb.partition:
        return pa.offset > pb.offset
    return a.sort_key() > b.sort_key()


def _latest(records: list[ReplayRecord]) -> ReplayRecord | None:
    latest: ReplayRecord | None = None
    for rec in records:
        if latest is None or _later(rec, latest):
            latest = rec
    return latest


def _latest_after(records: list[ReplayRecord], mark: ReplayRecord | None) -> ReplayRecord | None:
    """The latest of ``records`` written after ``mark`` (any of them when there is no mark)."""
    return _latest([rec for rec in records if mark is None or _later(rec, mark)])


def _watch_letter(rec: ReplayRecord) -> bool:
    """A dead letter of a WatchRequest (it names no task; its value is the request)."""
    letter = rec.record
    if not isinstance(letter, DeadLetter) or letter.task is not None or letter.value is None:
        return False
    try:
        data = orjson.loads(letter.value)
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and data.get("kind") == "watch_request"


@dataclass(slots=True)
class WatchTally:
    """A standing watch's events, counted as they are read: a watch fires far more often
    than a history keeps records (:data:`KEEP`), so its runs and events are counted here."""

    runs: dict[str, int] = field(default_factory=dict)
    """Events read per run id, in the order the runs were first seen."""
    fired: int = 0
    failed: int = 0

    @property
    def events(self) -> int:
        return self.fired + self.failed

    def count(self, event: WatchEvent) -> None:
        self.runs[event.run] = self.runs.get(event.run, 0) + 1
        if event.status == "fired":
            self.fired += 1
        else:
            self.failed += 1


@dataclass(slots=True)
class TriggerHistory:
    """Everything read about one trigger id."""

    trigger_id: str
    task: TaskKey | None = None
    requests: _Kept = field(default_factory=_Kept)
    tombstones: _Kept = field(default_factory=_Kept)
    cancels: _Kept = field(default_factory=_Kept)
    events: _Kept = field(default_factory=_Kept)
    copies: _Kept = field(default_factory=_Kept)
    """The events' copies on tasks.events (where the task's scheduler reads them)."""
    dead_letters: _Kept = field(default_factory=_Kept)
    runs: _Kept = field(default_factory=_Kept)
    undecodable: _Kept = field(default_factory=_Kept)
    watches: _Kept = field(default_factory=_Kept)
    """WatchRequest records: the trigger id is a standing watch, not a deferral."""
    watch_events: _Kept = field(default_factory=_Kept)
    """WatchEvent records (the watch's events and failed runs, on the resume topic)."""
    watch_tally: WatchTally = field(default_factory=WatchTally)

    @property
    def request(self) -> ReplayRecord | None:
        """The latest DeferRequest record."""
        return _latest(self.requests)

    @property
    def defer_request(self) -> DeferRequest | None:
        rec = self.request
        return rec.record if rec is not None and isinstance(rec.record, DeferRequest) else None

    @property
    def tombstone(self) -> ReplayRecord | None:
        """The tombstone written after the latest DeferRequest, if any."""
        return _latest_after(self.tombstones, self.request)

    @property
    def alive(self) -> bool:
        """The defer topic still holds this trigger as active (requested, not tombstoned)."""
        return self.request is not None and self.tombstone is None

    @property
    def is_watch(self) -> bool:
        """A standing watch: a WatchRequest, a WatchEvent or a watch's dead letter names it."""
        return bool(self.watches or self.watch_events) or any(
            _watch_letter(rec) for rec in self.dead_letters
        )

    @property
    def watch(self) -> ReplayRecord | None:
        """The latest WatchRequest record."""
        return _latest(self.watches)

    @property
    def watch_request(self) -> WatchRequest | None:
        rec = self.watch
        return rec.record if rec is not None and isinstance(rec.record, WatchRequest) else None

    @property
    def watch_tombstone(self) -> ReplayRecord | None:
        """The tombstone written after the latest WatchRequest (any, if none was read)."""
        return _latest_after(self.tombstones, self.watch)

    @property
    def watch_active(self) -> bool:
        """The watch is still in the defer table (requested, not tombstoned), so it runs on."""
        return self.watch is not None and self.watch_tombstone is None

    def ordered_events(self) -> list[ReplayRecord]:
        return self.events.ordered()

    def all_records(self) -> list[ReplayRecord]:
        lists = (self.requests, self.tombstones, self.cancels, self.events, self.copies)
        rest = (self.dead_letters, self.runs, self.undecodable, self.watches, self.watch_events)
        return [rec for kept in (*lists, *rest) for rec in kept]


@dataclass(slots=True)
class TaskHistory:
    """Everything read about one task instance (all attempts), keyed by ``ti_key``."""

    ti_key: str
    states: _Kept = field(default_factory=_Kept)
    runs: _Kept = field(default_factory=_Kept)
    dead_letters: _Kept = field(default_factory=_Kept)
    trigger_ids: dict[str, None] = field(default_factory=dict)
    latest: ReplayRecord | None = None

    @property
    def state(self) -> TaskStateRecord | None:
        rec = self.latest
        return rec.record if rec is not None and isinstance(rec.record, TaskStateRecord) else None

    def add_state(self, rec: ReplayRecord) -> None:
        self.states.keep(rec)
        if self.latest is None or _later(rec, self.latest):
            self.latest = rec

    def all_records(self) -> list[ReplayRecord]:
        return [*self.states, *self.runs, *self.dead_letters]


@dataclass(frozen=True, slots=True)
class OwnerGuess:
    """Which member owned a partition around a moment, as seen from records that name it.

    ``exact`` means the member was seen on that partition both before and after the moment
    (or at it); otherwise ``member`` is the last one seen before it (or the first after).
    """

    member: str
    first_seen: dt.datetime
    last_seen: dt.datetime
    exact: bool


@dataclass(slots=True)
class _Run:
    member: str
    first: dt.datetime
    last: dt.datetime


class OwnershipLog:
    """Runs of (member, first seen, last seen) per (trigger queue, partition).

    Triggerer events and dead letters name the member that ran the trigger and the partition;
    consecutive observations of one member merge into one run, so memory follows the number
    of ownership changes, not of records.
    """

    MAX_RUNS = 10_000

    def __init__(self) -> None:
        self._runs: dict[tuple[str | None, int], list[_Run]] = {}

    def observe(self, queue: str | None, partition: int, member: str, at: dt.datetime) -> None:
        runs = self._runs.setdefault((queue, partition), [])
        for run in reversed(runs[-4:]):
            if run.member == member and run.first <= at <= run.last:
                return
        last = runs[-1] if runs else None
        if last is not None and last.member == member and at >= last.first:
            last.last = max(last.last, at)
            return
        if last is not None and last.member == member and at < last.first:
            last.first = at
            return
        if len(runs) < self.MAX_RUNS:
            runs.append(_Run(member, at, at))

    def owner_at(self, queue: str | None, partition: int, at: dt.datetime) -> OwnerGuess | None:
        runs = sorted(self._runs.get((queue, partition), ()), key=lambda run: run.first)
        before: _Run | None = None
        after: _Run | None = None
        for run in runs:
            if run.first <= at <= run.last:
                return OwnerGuess(run.member, run.first, run.last, exact=True)
            if run.last < at:
                before = run
            elif after is None:
                after = run
        if before is not None:
            exact = after is not None and after.member == before.member
            return OwnerGuess(before.member, before.first, before.last, exact=exact)
        if after is not None:
            return OwnerGuess(after.member, after.first, after.last, exact=False)
        return None

    def members(self, queue: str | None, partition: int) -> list[str]:
        return [run.member for run in self._runs.get((queue, partition), ())]

    def __len__(self) -> int:
        return sum(len(runs) for runs in self._runs.values())


class ReplayIndex:
    """Folds decoded records into trigger and task histories; the order of topics may interleave."""

    def __init__(self, *, prefix: str = "deferline.") -> None:
        self.prefix = prefix
        self.triggers: dict[str, TriggerHistory] = {}
        self.tasks: dict[str, TaskHistory] = {}
        self.owners = OwnershipLog()
        self.counts: Counter[str] = Counter()
        self.undecodable = _Kept()

    def trigger(self, trigger_id: str) -> TriggerHistory:
        found = self.triggers.get(trigger_id)
        if found is None:
            found = self.triggers[trigger_id] = TriggerHistory(trigger_id)
        return found

    def task(self, ti_key: str) -> TaskHistory:
        found = self.tasks.get(ti_key)
        if found is None:
            found = self.tasks[ti_key] = TaskHistory(ti_key)
        return found

    def add(self, rec: ReplayRecord) -> None:
        self.counts[rec.kind] += 1
        record = rec.record
        if record is None:
            self._add_bare(rec)
        elif isinstance(record, DeferRequest):
            history = self.trigger(record.trigger_id)
            history.requests.keep(rec)
            history.task = record.task
            self.task(record.task.ti_key).trigger_ids[record.trigger_id] = None
        elif isinstance(record, CancelRequest):
            history = self.trigger(record.trigger_id)
            history.cancels.keep(rec)
            history.task = history.task or record.task
        elif isinstance(record, TriggerEventRecord):
            history = self.trigger(record.trigger_id)
            history.task = history.task or record.task
            self.task(record.task.ti_key).trigger_ids[record.trigger_id] = None
            if rec.role is TopicRole.TASK_EVENTS:
                history.copies.keep(rec)  # the same event again, not another one
            else:
                history.events.keep(rec)
            self._observe(rec, record)
        elif isinstance(record, WatchRequest):
            self.trigger(record.trigger_id).watches.keep(rec)
        elif isinstance(record, WatchEvent):
            history = self.trigger(record.trigger_id)
            history.watch_events.keep(rec)
            history.watch_tally.count(record)
            self._observe(rec, record)
        elif isinstance(record, TaskStateRecord):
            task = self.task(record.task.ti_key)
            task.add_state(rec)
            if record.trigger_id:
                task.trigger_ids[record.trigger_id] = None
        elif isinstance(record, RunTask):
            self.task(record.task.ti_key).runs.keep(rec)
            if record.trigger_id:
                self.trigger(record.trigger_id).runs.keep(rec)
        elif isinstance(record, DeadLetter):
            self._add_dead_letter(rec, record)

    def _observe(self, rec: ReplayRecord, record: TriggerEventRecord | WatchEvent) -> None:
        """An event names the member that ran its trigger, and the partition it owned."""
        if record.member:
            partition = rec.position.partition if record.partition is None else record.partition
            queue = record.queue if record.queue is not None else rec.queue
            self.owners.observe(_norm(queue), partition, record.member, record.emitted_at)

    def _add_bare(self, rec: ReplayRecord) -> None:
        if rec.tombstone:
            if rec.role is TopicRole.DEFER and rec.key is not None:
                self.trigger(rec.key).tombstones.keep(rec)
            return
        self.undecodable.keep(rec)
        if rec.role in (TopicRole.DEFER, TopicRole.RESUME) and rec.key is not None:
            self.trigger(rec.key).undecodable.keep(rec)

    def _add_dead_letter(self, rec: ReplayRecord, record: DeadLetter) -> None:
        trigger_id = rec.trigger_id
        if trigger_id:
            history = self.trigger(trigger_id)
            history.dead_letters.keep(rec)
            history.task = history.task or record.task
        if record.task is not None:
            task = self.task(record.task.ti_key)
            task.dead_letters.keep(rec)
            if trigger_id:
                task.trigger_ids[trigger_id] = None
        origin = classify_topic(record.topic, prefix=self.prefix)
        if record.member and origin is not None and origin.role is TopicRole.DEFER:
            self.owners.observe(
                _norm(origin.queue), record.partition, record.member, record.failed_at
            )

    def records_about(self, *, trigger_ids: set[str], ti_keys: set[str]) -> list[ReplayRecord]:
        """Every record kept about these triggers and tasks, once each, in time order."""
        seen: dict[tuple[str, int, int], ReplayRecord] = {}
        for trigger_id in trigger_ids:
            history = self.triggers.get(trigger_id)
            for rec in history.all_records() if history else ():
                seen[(rec.position.topic, rec.position.partition, rec.position.offset)] = rec
        for ti_key in ti_keys:
            task = self.tasks.get(ti_key)
            for rec in task.all_records() if task else ():
                seen[(rec.position.topic, rec.position.partition, rec.position.offset)] = rec
        return sorted(seen.values(), key=ReplayRecord.sort_key)
