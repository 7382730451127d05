"""A timeline: every record about a task or trigger, in time order, with who owned it then."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from deferline.schemas import DeadLetter, TriggerEventRecord, WatchEvent

from ._fold import ReplayIndex
from ._records import Position, ReplayRecord, describe
from ._topics import TopicRole
from ._verdict import Subject
from ._verdict_progress import scheduler_decisions

__all__ = ["TimelineEntry", "build_timeline", "subject_ids"]


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """One record on a timeline.

    ``owner`` is the triggerer member that owned the record's defer/resume partition at that
    moment, when records say so: ``owner_exact`` is True when the record names its member or
    the member was seen on that partition before and after it. ``decision`` is what the
    scheduler's dedup does with an event (``applied``, ``duplicate``, ...).
    """

    at: dt.datetime | None
    position: Position
    role: TopicRole
    kind: str
    description: str
    trigger_id: str | None
    owner: str | None = None
    owner_exact: bool = False
    decision: str | None = None
    record: ReplayRecord | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.at.isoformat() if self.at else None,
            "topic": self.position.topic,
            "partition": self.position.partition,
            "offset": self.position.offset,
            "broker_timestamp": (
                self.position.timestamp.isoformat() if self.position.timestamp else None
            ),
            "role": self.role.value,
            "kind": self.kind,
            "description": self.description,
            "trigger_id": self.trigger_id,
            "owner": self.owner,
            "owner_exact": self.owner_exact,
            "scheduler": self.decision,
            "record": (
                self.record.record.model_dump(mode="json")
                if self.record is not None and self.record.record is not None
                else None
            ),
            "error": self.record.error if self.record is not None else None,
        }


def subject_ids(index: ReplayIndex, subject: Subject) -> tuple[set[str], set[str]]:
    """The trigger ids and task keys a subject covers, following links both ways."""
    trigger_ids: set[str] = set()
    ti_keys: set[str] = set()
    if subject.trigger_id is not None:
        trigger_ids.add(subject.trigger_id)
        history = index.triggers.get(subject.trigger_id)
        if history is not None and history.task is not None:
            ti_keys.add(history.task.ti_key)
        for ti_key, known in index.tasks.items():
            if subject.trigger_id in known.trigger_ids:
                ti_keys.add(ti_key)
    if subject.ti_key is not None:
        ti_keys.add(subject.ti_key)
        task = index.tasks.get(subject.ti_key)
        if task is not None:
            trigger_ids.update(task.trigger_ids)
        for tid, history in index.triggers.items():
            if history.task is not None and history.task.ti_key == subject.ti_key:
                trigger_ids.add(tid)
    return trigger_ids, ti_keys


def _owner(index: ReplayIndex, rec: ReplayRecord) -> tuple[str | None, bool]:
    record = rec.record
    if isinstance(record, TriggerEventRecord | WatchEvent | DeadLetter) and record.member:
        return record.member, True
    if rec.role not in (TopicRole.DEFER, TopicRole.RESUME) or rec.at is None:
        return None, False
    queue = None if rec.queue in (None, "default") else rec.queue
    guess = index.owners.owner_at(queue, rec.position.partition, rec.at)
    if guess is None:
        return None, False
    return guess.member, guess.exact


def build_timeline(
    index: ReplayIndex, subject: Subject, *, try_number: int | None = None
) -> list[TimelineEntry]:
    """All records about the subject (its task and every trigger of it), oldest first."""
    trigger_ids, ti_keys = subject_ids(index, subject)
    records = index.records_about(trigger_ids=trigger_ids, ti_keys=ti_keys)
    if try_number is not None:
        records = [r for r in records if r.task is None or r.task.try_number == try_number]
    decisions = {}
    for ti_key in ti_keys:
        task = index.tasks.get(ti_key)
        histories = [h for h in index.triggers.values() if h.task and h.task.ti_key == ti_key]
        decisions.update(scheduler_decisions(task, histories))
    entries = []
    for rec in records:
        owner, exact = _owner(index, rec)
        entries.append(
            TimelineEntry(
                at=rec.at,
                position=rec.position,
                role=rec.role,
                kind=rec.kind,
                description=describe(rec),
                trigger_id=rec.trigger_id,
                owner=owner,
                owner_exact=exact,
                decision=decisions.get(rec.position),
                record=rec,
            )
        )
    return entries
