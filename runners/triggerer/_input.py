"""What one defer-topic value asks the triggerer to do: start, cancel, or dead-letter.

Pure apart from importing the trigger class: bytes in, a decision out. Every way a record
can be bad (no key, undecodable bytes, an unknown schema version, a classpath outside the
allowlist, an import error, bad or undecryptable kwargs) becomes :class:`BadRecord` with
the reason and, where the task can still be identified, the task and trigger id so it
gets a failure event that explains why.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from deferline.engine import BaseTrigger, TriggerLoadError, load_trigger, watch_assets
from deferline.schemas import (
    CancelRequest,
    DecryptionError,
    DeferFields,
    DeferlineError,
    KwargsCipher,
    SchemaError,
    TaskKey,
    WatchRequest,
    decode_deferral,
    open_kwargs,
)
from pydantic import ValidationError

__all__ = [
    "BadRecord",
    "CancelTrigger",
    "StartTrigger",
    "StartWatch",
    "interpret",
    "peek_identity",
]


@dataclass(slots=True)
class StartTrigger:
    """A valid DeferRequest (what running it needs) and the trigger instance built from it."""

    request: DeferFields
    trigger: BaseTrigger


@dataclass(slots=True)
class StartWatch:
    """A valid WatchRequest and the trigger instance built from it (one run of the watch)."""

    request: WatchRequest
    trigger: BaseTrigger


@dataclass(frozen=True, slots=True)
class CancelTrigger:
    """A CancelRequest for the trigger under this key."""

    request: CancelRequest


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A value that cannot be run, with the reason and whatever identifies its task."""

    error: str
    error_type: str
    trigger_id: str | None = None
    task: TaskKey | None = None
    defer_seq: int = 0
    watch: bool = False
    """A WatchRequest: no task to tell, its publisher hears of it through a failed
    WatchEvent."""

    @property
    def identified(self) -> bool:
        """True when the task can be told about it with a failure event."""
        return self.trigger_id is not None and self.task is not None


Decision = StartTrigger | StartWatch | CancelTrigger | BadRecord


def peek_identity(value: bytes | None) -> tuple[str | None, TaskKey | None, int]:
    """Best-effort trigger id, task and defer_seq of a value that failed to decode."""
    if value is None:
        return None, None, 0
    try:
        raw: Any = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None, None, 0
    if not isinstance(raw, dict):
        return None, None, 0
    trigger_id = raw.get("trigger_id")
    if not isinstance(trigger_id, str) or not trigger_id:
        trigger_id = None
    try:
        task = TaskKey.model_validate(raw.get("task"))
    except ValidationError:
        task = None
    defer_seq = raw.get("defer_seq", 0)
    return trigger_id, task, defer_seq if isinstance(defer_seq, int) else 0


def _bad(error: BaseException | str, error_type: str | None, value: bytes | None) -> BadRecord:
    trigger_id, task, defer_seq = peek_identity(value)
    return BadRecord(
        error=str(error),
        error_type=error_type or type(error).__name__,
        trigger_id=trigger_id,
        task=task,
        defer_seq=defer_seq,
    )


class RecordReader:
    """Decides what one lane's defer-topic records call for, under its allowed prefixes and
    kwargs cipher. Owns the cache of the trigger classes it resolved (a rebuild resolves the
    same few classpaths for every record), shared by everything of the lane that reads."""

    def __init__(self, *, allowed_prefixes: Sequence[str], cipher: KwargsCipher | None) -> None:
        self._allowed = tuple(allowed_prefixes)
        self._cipher = cipher
        self._classes: dict[str, type[BaseTrigger]] = {}

    def __call__(self, key: bytes | None, value: bytes) -> Decision:
        return interpret(
            key, value, allowed_prefixes=self._allowed, cipher=self._cipher, classes=self._classes
        )


def interpret(
    key: bytes | None,
    value: bytes,
    *,
    allowed_prefixes: Sequence[str],
    cipher: KwargsCipher | None,
    classes: MutableMapping[str, type[BaseTrigger]] | None = None,
) -> Decision:
    """Decide what to do with one (non-tombstone) defer-topic record.

    ``classes``: a cache of resolved trigger classes for these ``allowed_prefixes`` (see
    :func:`deferline.engine.load_trigger`).
    """
    if key is None:
        return _bad("record has no key (the key must be the trigger id)", "MissingKey", value)
    try:
        key_text = key.decode()
    except UnicodeDecodeError:
        return _bad("record key is not UTF-8", "BadKey", value)
    try:
        record = decode_deferral(value)
    except SchemaError as exc:
        return _bad(exc, None, value)
    if not isinstance(record, DeferFields | CancelRequest | WatchRequest):
        return _bad(
            f"a {record.__class__.__name__} does not belong on a defer topic", "WrongKind", value
        )
    if record.trigger_id != key_text:
        return BadRecord(
            error=f"record key {key_text!r} differs from its trigger_id {record.trigger_id!r}",
            error_type="KeyMismatch",
            trigger_id=record.trigger_id,
            task=None if isinstance(record, WatchRequest) else record.task,
            defer_seq=0 if isinstance(record, WatchRequest) else record.defer_seq,
            watch=isinstance(record, WatchRequest),
        )
    if isinstance(record, WatchRequest):
        return _watch(record, allowed_prefixes, cipher, classes)
    if isinstance(record, CancelRequest):
        return CancelTrigger(record)
    try:
        kwargs = open_kwargs(record, cipher)
        trigger = load_trigger(
            record.classpath, kwargs, allowed_prefixes=allowed_prefixes, classes=classes
        )
    except (DecryptionError, TriggerLoadError, DeferlineError, Exception) as exc:
        # Anything a third-party trigger's import or __init__ raises is bad input too.
        return BadRecord(
            error=str(exc),
            error_type=type(exc).__name__,
            trigger_id=record.trigger_id,
            task=record.task,
            defer_seq=record.defer_seq,
        )
    trigger.trigger_id = record.trigger_id
    trigger.task_instance = record.task  # dag_id, task_id, run_id, map_index, try_number
    return StartTrigger(record, trigger)


def _watch(
    request: WatchRequest,
    allowed_prefixes: Sequence[str],
    cipher: KwargsCipher | None,
    classes: MutableMapping[str, type[BaseTrigger]] | None,
) -> StartWatch | BadRecord:
    """A run of a watch, or why it cannot run (no task to tell: the record is dead-lettered)."""
    try:
        kwargs = open_kwargs(request, cipher)
        trigger = load_trigger(
            request.classpath, kwargs, allowed_prefixes=allowed_prefixes, classes=classes
        )
    except Exception as exc:  # as for a deferral: anything its import or __init__ raises
        return BadRecord(
            error=str(exc),
            error_type=type(exc).__name__,
            trigger_id=request.trigger_id,
            watch=True,
        )
    trigger.trigger_id = request.trigger_id
    trigger.task_instance = None
    watch_assets(trigger, [(a.name, a.uri) for a in request.assets])
    return StartWatch(request, trigger)
