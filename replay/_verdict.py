"""Verdicts: what a replay concludes about one deferral, and what every verdict family shares.

A :class:`Verdict` is a :class:`VerdictKind` with its evidence (the records that prove it);
the families that reach one live in ``_verdict_*`` modules, picked by :mod:`._explain`.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from deferline.schemas import (
    KwargsCipher,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
)

from ._errors import BadSubject
from ._fold import ReplayIndex, TaskHistory, TriggerHistory
from ._live import LiveView
from ._records import Position, ReplayRecord, describe

__all__ = [
    "Evidence",
    "ReplayContext",
    "Subject",
    "Verdict",
    "VerdictKind",
    "parse_subject",
]

_DIGITS = re.compile(r"^-?\d+$")
_TASKTABLE_LOGGER = "deferline.engine._taskstate"


class VerdictKind(StrEnum):
    """What a replay concludes about one deferral."""

    NOT_FOUND = "not_found"
    """No record on any topic names it (in the range read)."""
    NOT_DEFERRED = "not_deferred"
    """The task is not waiting on a trigger."""
    NEVER_REQUESTED = "never_requested"
    """The task was marked deferred but no DeferRequest was ever produced."""
    NO_LIVE_TRIGGERER = "no_live_triggerer"
    """Requested; no live triggerer reads (or is assigned) its defer partition."""
    NO_TRIGGERER_FOR_QUEUE = "no_triggerer_for_queue"
    """Requested on a trigger queue that no live triggerer serves (others are alive)."""
    RUNNING = "running"
    """Requested, owned by a live triggerer member, not fired yet."""
    WAITING = "waiting"
    """Requested, not fired; the live groups were not read, so the owner is unknown."""
    FIRED_NOT_APPLIED = "fired_not_applied"
    """Fired, but the task is not (or not yet) resumed by the scheduler."""
    EVENT_NOT_COPIED = "event_not_copied"
    """The event is on the resume topic but not on tasks.events, where the scheduler reads."""
    TIMED_OUT = "timed_out"
    """The trigger reached its timeout."""
    TRIGGER_FAILED = "trigger_failed"
    """The trigger raised (traceback in the evidence)."""
    CLASSPATH_NOT_ALLOWED = "classpath_not_allowed"
    """Dead-lettered: the classpath is outside the allowed prefixes."""
    IMPORT_ERROR = "import_error"
    """Dead-lettered: the trigger class could not be imported."""
    UNDECRYPTABLE_KWARGS = "undecryptable_kwargs"
    """Dead-lettered: no configured key opens the sealed kwargs."""
    BAD_REQUEST = "bad_request"
    """Dead-lettered or undecodable for another reason (bad kwargs, schema, key)."""
    CANCELLED = "cancelled"
    """Cancelled (the task was cleared), or a cancel is requested and not yet acted on."""
    RESUME_NOT_PICKED_UP = "resume_not_picked_up"
    """Resumed by the scheduler; no worker has started the resumed task."""
    RESUMED = "resumed"
    """The deferral completed: the task was resumed and a worker picked it up."""
    FINISHED_WITHOUT_EVENT = "finished_without_event"
    """Tombstoned on the defer topic, but no event is on the resume topic."""
    WATCH = "watch"
    """A standing watch, not a deferral: no task waits on it (its runs, events, and whether
    it is still active)."""


ENDINGS = frozenset(
    {
        VerdictKind.TIMED_OUT,
        VerdictKind.TRIGGER_FAILED,
        VerdictKind.CLASSPATH_NOT_ALLOWED,
        VerdictKind.IMPORT_ERROR,
        VerdictKind.UNDECRYPTABLE_KWARGS,
        VerdictKind.BAD_REQUEST,
        VerdictKind.CANCELLED,
    }
)
"""Verdicts that explain how a deferral ended (and so why a task failed or was removed)."""

_DEAD_LETTER_KINDS: Mapping[str, VerdictKind] = {
    "TriggerNotAllowed": VerdictKind.CLASSPATH_NOT_ALLOWED,
    "TriggerImportError": VerdictKind.IMPORT_ERROR,
    "ModuleNotFoundError": VerdictKind.IMPORT_ERROR,
    "ImportError": VerdictKind.IMPORT_ERROR,
    "DecryptionError": VerdictKind.UNDECRYPTABLE_KWARGS,
}


@dataclass(frozen=True, slots=True)
class Subject:
    """What a replay command is asked about: a trigger id, or a task instance."""

    text: str
    trigger_id: str | None = None
    ti_key: str | None = None
    try_number: int | None = None


def parse_subject(text: str) -> Subject:
    """``TRIGGER_ID`` or ``dag_id/task_id/run_id[/map_index][#try_number]``.

    dag and task ids cannot contain ``/``; the rest is the run id, and a last segment that is
    an integer is the map index (-1 when absent).
    """
    text = text.strip()
    if not text:
        raise BadSubject("empty task key or trigger id")
    if "/" not in text:
        return Subject(text, trigger_id=text)
    base, try_number = text, None
    head, sep, tail = text.rpartition("#")
    if sep and tail.isdigit():
        base, try_number = head, int(tail)
    parts = base.split("/")
    if len(parts) < 3 or not parts[0] or not parts[1] or not "/".join(parts[2:]):
        raise BadSubject(
            f"{text!r} is neither a trigger id nor dag_id/task_id/run_id[/map_index][#try]"
        )
    dag_id, task_id, rest = parts[0], parts[1], "/".join(parts[2:])
    run_id, map_index = rest, -1
    if len(parts) > 3 and _DIGITS.match(parts[-1]):
        run_id, map_index = "/".join(parts[2:-1]), int(parts[-1])
    return Subject(text, ti_key=f"{dag_id}/{task_id}/{run_id}/{map_index}", try_number=try_number)


@dataclass(frozen=True, slots=True)
class Evidence:
    """One fact behind a verdict: a record (with its position) or a live observation."""

    note: str
    at: dt.datetime | None = None
    position: Position | None = None
    kind: str | None = None
    detail: str | None = None

    @classmethod
    def of(cls, note: str, rec: ReplayRecord) -> Evidence:
        return cls(note, rec.at, rec.position, rec.kind, describe(rec))

    def to_json(self) -> dict[str, Any]:
        pos = self.position
        return {
            "note": self.note,
            "at": _iso(self.at),
            "topic": pos.topic if pos else None,
            "partition": pos.partition if pos else None,
            "offset": pos.offset if pos else None,
            "broker_timestamp": _iso(pos.timestamp) if pos else None,
            "kind": self.kind,
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to "why": a kind, a cause within it, a sentence, and the evidence."""

    kind: VerdictKind
    subject: str
    summary: str
    cause: str | None = None
    task: TaskKey | None = None
    trigger_id: str | None = None
    state: str | None = None
    since: dt.datetime | None = None
    evidence: tuple[Evidence, ...] = ()
    facts: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "verdict": self.kind.value,
            "cause": self.cause,
            "summary": self.summary,
            "task": self.task.model_dump(mode="json") if self.task else None,
            "ti_key": self.task.ti_key if self.task else None,
            "trigger_id": self.trigger_id,
            "state": self.state,
            "since": _iso(self.since),
            "facts": {k: _jsonable(v) for k, v in self.facts.items()},
            "evidence": [e.to_json() for e in self.evidence],
        }


@dataclass(frozen=True, slots=True)
class ReplayContext:
    """What a verdict may assume besides the records.

    ``now`` is the reference time (ages, overdue timers); ``live`` is the consumer-group
    snapshot (None: not read, ownership unknown); ``cipher`` opens sealed kwargs to find a
    timer's due time; ``bounded`` says the read was limited by time or offsets, so an absent
    record may only be outside the range; ``events_copied`` is the deployment's
    ``Settings.copy_events_to_tasks`` (off: no event has a copy on tasks.events, and none is
    missing).
    """

    now: dt.datetime
    live: LiveView | None = None
    cipher: KwargsCipher | None = None
    bounded: bool = False
    events_copied: bool = True


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _when(now: dt.datetime, then: dt.datetime | None) -> str:
    if then is None:
        return "an unknown time"
    return f"{then.isoformat(timespec='seconds')} ({_span((now - then).total_seconds())} ago)"


def _ago(now: dt.datetime, then: dt.datetime | None) -> str:
    return f"at {_when(now, then)}"


def _span(seconds: float) -> str:
    sign = "-" if seconds < 0 else ""
    s = abs(seconds)
    if s < 1:
        return f"{sign}{s * 1000:.0f} ms"
    if s < 120:
        return f"{sign}{s:.1f} s"
    if s < 7200:
        return f"{sign}{s / 60:.1f} min"
    if s < 172800:
        return f"{sign}{s / 3600:.1f} h"
    return f"{sign}{s / 86400:.1f} d"


def _norm_queue(queue: str | None) -> str | None:
    return None if queue in (None, "default") else queue


# -- scheduler decisions -----------------------------------------------------------------------


@dataclass(slots=True)
class _Case:
    """Everything known about one trigger while its verdict is worked out."""

    name: str
    trigger_id: str
    ctx: ReplayContext
    index: ReplayIndex
    history: TriggerHistory | None
    task_key: TaskKey | None
    task: TaskHistory | None
    deferred: ReplayRecord | None  # the task's "deferred" record on this trigger
    evidence: list[Evidence] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def state(self) -> TaskStateRecord | None:
        return self.task.state if self.task else None

    @property
    def deferred_here(self) -> bool:
        state = self.state
        return (
            state is not None and state.state == "deferred" and state.trigger_id == self.trigger_id
        )

    def verdict(
        self,
        kind: VerdictKind,
        summary: str,
        *,
        cause: str | None = None,
        since: dt.datetime | None = None,
    ) -> Verdict:
        state = self.state
        task = self.task_key or (state.task if state else None)
        if state is not None:
            self.facts.setdefault("state", state.state)
        return Verdict(
            kind,
            self.name,
            summary,
            cause=cause,
            task=task,
            trigger_id=self.trigger_id,
            state=state.state if state else None,
            since=since,
            evidence=tuple(self.evidence),
            facts=dict(self.facts),
        )

    def add(self, note: str, rec: ReplayRecord | None) -> None:
        if rec is not None and not any(e.position == rec.position for e in self.evidence):
            self.evidence.append(Evidence.of(note, rec))

    def live_note(self, note: str) -> None:
        self.evidence.append(Evidence(note, self.ctx.live.taken_at if self.ctx.live else None))


def _event(rec: ReplayRecord) -> TriggerEventRecord:
    assert isinstance(rec.record, TriggerEventRecord)
    return rec.record


def _state_text(state: TaskStateRecord | None) -> str:
    if state is None:
        return "its state is unknown"
    text = f"it is {state.state}, try {state.task.try_number}"
    if state.trigger_id:
        text += f", on trigger {state.trigger_id}"
    return text


def _resume_queued(state: TaskStateRecord) -> bool:
    """Queued (or scheduled) by the scheduler after an event, waiting for a worker."""
    return (
        state.state in ("queued", "scheduled")
        and state.trigger_id is not None
        and state.next_method is not None
    )
