"""Wire models: every message deferline writes to a topic.

Each record carries ``kind`` (the discriminator) and ``version`` (the schema version). The
models are frozen data with no I/O. Values whose types JSON lacks (datetimes in trigger
kwargs, for instance) travel in the tagged form of :mod:`._codec`. Field-by-field reference:
``docs/protocol.md``; JSON Schemas: ``docs/schemas/``.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ._codec import TAGS, canonical_json, from_tagged, to_tagged
from ._errors import SchemaError

SCHEMA_VERSION = 1
_NAME = r"^[A-Za-z0-9_.\-]+$"
_NO_CONTROL = r"^[^\x00-\x1f\x7f]+$"
QUEUE_PATTERN = r"^[A-Za-z0-9_\-]+$"
QUEUE_MAX = 64
TRIGGER_ID_MAX = 200
_TRIGGER_NS = uuid.UUID("6f1c2d0e-9a43-4f57-8f3e-1f0a4d2b7c55")
WIRE_CONTEXT = {"wire": True}


def _on_wire(info: ValidationInfo) -> bool:
    return info.mode == "json" or bool((info.context or {}).get("wire"))


def _validate_tagged(value: Any, info: ValidationInfo) -> Any:
    if not _on_wire(info):
        return value
    try:
        return from_tagged(value)
    except SchemaError as exc:
        # ``path`` lets the wire layer report "kwargs.moment" rather than just "kwargs".
        raise PydanticCustomError(
            "tagged_value", "{reason}", {"reason": exc.reason, "path": exc.field or ""}
        ) from exc


def _validate_tagged_dict(value: Any, info: ValidationInfo) -> dict[Any, Any]:
    value = _validate_tagged(value, info)
    if isinstance(value, dict):
        return value
    if isinstance(value, Mapping):
        return dict(value)
    raise PydanticCustomError(
        "tagged_object", "expected an object, got {type}", {"type": type(value).__name__}
    )


def _serialize_tagged(value: Any) -> Any:
    return to_tagged(value)


def _validate_bytes(value: Any, info: ValidationInfo) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        if not _on_wire(info):
            return value.encode()
        try:
            urlsafe = "-" in value or "_" in value
            return base64.b64decode(value, altchars=b"-_" if urlsafe else None, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise PydanticCustomError(
                "wire_bytes", "not base64: {error}", {"error": str(exc)}
            ) from exc
    raise PydanticCustomError(
        "wire_bytes", "expected base64 text, got {type}", {"type": type(value).__name__}
    )


def _serialize_bytes(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


_TAGGED_SCHEMA: dict[str, Any] = {
    "description": (
        "Any JSON value. Values JSON lacks are tagged as "
        '{"__type": ' + "|".join(f'"{tag}"' for tag in TAGS) + ', "__var": ...}'
        " (see docs/protocol.md)."
    )
}

Tagged = Annotated[
    Any,
    PlainValidator(_validate_tagged),
    PlainSerializer(_serialize_tagged, when_used="json"),
    WithJsonSchema(_TAGGED_SCHEMA),
]
TaggedDict = Annotated[
    dict[str, Any],
    PlainValidator(_validate_tagged_dict),
    PlainSerializer(_serialize_tagged, when_used="json"),
    WithJsonSchema({"type": "object", **_TAGGED_SCHEMA}),
]
WireBytes = Annotated[
    bytes,
    PlainValidator(_validate_bytes),
    PlainSerializer(_serialize_bytes, when_used="json-unless-none"),
    WithJsonSchema({"type": "string", "contentEncoding": "base64"}),
]
QueueName = Annotated[str, Field(pattern=QUEUE_PATTERN, max_length=QUEUE_MAX)]
TaskState = Literal[
    "scheduled",
    "queued",
    "running",
    "deferred",
    "success",
    "failed",
    "skipped",
    "up_for_retry",
    "removed",
]
EventStatus = Literal["fired", "failed", "timed_out", "cancelled"]
TaskOutcome = Literal["success", "failed", "skipped"]


def utcnow() -> dt.datetime:
    """Now, timezone-aware in UTC (the only clock the wire format accepts)."""
    return dt.datetime.now(dt.UTC)


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class _Record(_Wire):
    version: int = Field(default=SCHEMA_VERSION, description="Schema version of this record.")


class TaskKey(_Wire):
    """One attempt of one task instance, as Airflow names it."""

    dag_id: str = Field(min_length=1, max_length=250, pattern=_NAME)
    task_id: str = Field(min_length=1, max_length=250, pattern=_NAME)
    run_id: str = Field(min_length=1, max_length=250, pattern=_NO_CONTROL)
    map_index: int = Field(default=-1, ge=-1, description="-1 when the task is not mapped.")
    try_number: int = Field(default=1, ge=0)

    @property
    def ti_key(self) -> str:
        """Key of the task instance across attempts: ``dag_id/task_id/run_id/map_index``."""
        return ti_key_of(self.dag_id, self.task_id, self.run_id, self.map_index)

    def __str__(self) -> str:
        return f"{self.ti_key}#{self.try_number}"


def ti_key_of(dag_id: str, task_id: str, run_id: str, map_index: int) -> str:
    """The tasks topic's key of a task instance (``TaskKey.ti_key``) from its parts, for
    callers holding a task's wire JSON rather than a :class:`TaskKey`."""
    return f"{dag_id}/{task_id}/{run_id}/{map_index}"


def make_trigger_id(task: TaskKey, defer_seq: int) -> str:
    """Deterministic trigger id of the ``defer_seq``-th deferral of one task attempt.

    A retried publish of the same deferral carries the same id, so it overwrites itself in
    the compacted defer topic instead of starting a second trigger. The id is
    ``uuid5(6f1c2d0e-9a43-4f57-8f3e-1f0a4d2b7c55, NAME)`` where NAME is dag_id, task_id,
    run_id, map_index, try_number and defer_seq (integers in decimal) joined by U+001F,
    so any language can compute it (``docs/protocol.md``).
    """
    name = "\x1f".join(
        (
            task.dag_id,
            task.task_id,
            task.run_id,
            str(task.map_index),
            str(task.try_number),
            str(defer_seq),
        )
    )
    return str(uuid.uuid5(_TRIGGER_NS, name))


def make_event_id(
    trigger_id: str, status: str, payload: Any, *, canonical: bytes | None = None
) -> str:
    """Deterministic event id: the same event from two copies of a trigger has one id.

    32 hex digits of BLAKE2b-128 over ``trigger_id 0x1F status 0x1F canonical(payload)``,
    where canonical is the tagged JSON with sorted keys (and sorted pairs of tagged dicts),
    so neither dict order nor set order changes the id. ``canonical``: the payload's
    :func:`canonical_json`, when the caller has it already (timers of a burst share one).
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(trigger_id.encode())
    digest.update(b"\x1f" + status.encode() + b"\x1f")
    digest.update(canonical_json(payload) if canonical is None else canonical)
    return digest.hexdigest()


def _sealed_kwargs_are_empty(value: str | None, info: ValidationInfo) -> str | None:
    """A request's kwargs travel in clear or sealed in ``kwargs_token``, never both."""
    if value is not None and info.data.get("kwargs"):
        raise ValueError("kwargs must be empty when kwargs_token carries them (sealed)")
    return value


class ResumeTarget(_Wire):
    """What a worker needs to resume the task: the operator and where to run it."""

    operator: str = Field(
        description="Import path of the operator class, e.g. 'pkg.mod.MyOperator'."
    )
    op_kwargs: TaggedDict = Field(default_factory=dict)
    worker_queue: QueueName = "default"
    pool: str = "default_pool"
    pool_slots: int = Field(default=1, ge=1)
    priority_weight: int = 1
    retries: int = Field(default=0, ge=0)


class DeferRequest(_Record):
    """A task asks for a trigger to run; value of the defer topic, keyed by ``trigger_id``."""

    kind: Literal["defer_request"] = "defer_request"
    trigger_id: str = Field(min_length=1, max_length=TRIGGER_ID_MAX)
    task: TaskKey
    defer_seq: int = Field(
        default=0, ge=0, description="How many times this attempt deferred before."
    )
    classpath: str = Field(min_length=1, description="Import path of the trigger class.")
    kwargs: TaggedDict = Field(
        default_factory=dict, description="Trigger kwargs (empty when sealed)."
    )
    kwargs_token: str | None = Field(
        default=None, min_length=1, description="Fernet token of the tagged-JSON kwargs, if sealed."
    )
    next_method: str = "execute_complete"
    next_kwargs: TaggedDict | None = None
    timeout_at: AwareDatetime | None = Field(
        default=None, description="Absolute deadline of the trigger."
    )
    queue: QueueName | None = Field(
        default=None, description="Trigger queue; null is the default queue."
    )
    end_from_trigger: bool = False
    requested_at: AwareDatetime = Field(default_factory=utcnow)
    resume: ResumeTarget | None = Field(default=None, description="How to resume it on a worker.")

    _sealed = field_validator("kwargs_token")(_sealed_kwargs_are_empty)


class CancelRequest(_Record):
    """Stop a trigger wherever it runs (task cleared or marked); keyed by ``trigger_id``."""

    kind: Literal["cancel_request"] = "cancel_request"
    trigger_id: str = Field(min_length=1, max_length=TRIGGER_ID_MAX)
    task: TaskKey
    defer_seq: int = Field(default=0, ge=0)
    reason: str = "cancelled"
    requested_at: AwareDatetime = Field(default_factory=utcnow)


class TriggerEventRecord(_Record):
    """A trigger fired, failed, timed out or was cancelled; value of the resume topic."""

    kind: Literal["trigger_event"] = "trigger_event"
    event_id: str = Field(min_length=1, description="make_event_id(trigger_id, status, payload).")
    trigger_id: str = Field(min_length=1)
    task: TaskKey
    defer_seq: int = 0
    status: EventStatus
    payload: Tagged = None
    task_outcome: TaskOutcome | None = Field(
        default=None, description="Set when the trigger ends the task itself (end_from_trigger)."
    )
    xcoms: TaggedDict | None = None
    error: str | None = None
    traceback: str | None = None
    due_at: AwareDatetime | None = Field(default=None, description="When a timer was due.")
    emitted_at: AwareDatetime = Field(default_factory=utcnow)
    member: str | None = Field(default=None, description="Consumer-group member that ran it.")
    partition: int | None = None
    queue: QueueName | None = None
    resumed_directly: bool = Field(
        default=False, description="The triggerer already enqueued the RunTask (direct resume)."
    )


class AssetRef(_Wire):
    """An asset a standing watch feeds (Airflow's name and URI): what its trigger may read."""

    name: str = Field(min_length=1, max_length=1500)
    uri: str = Field(min_length=1, max_length=1500)


class WatchRequest(_Record):
    """A standing watch: a trigger that runs until it is tombstoned, each event of it
    published, none ending it. Value of the defer topic, keyed by ``trigger_id``.

    No task waits on a watch (Airflow's asset watchers): its events go to the resume topic
    only, as :class:`WatchEvent`. A run that ends or fails is started again, with backoff,
    unless the watch is ``once`` (then it ends with that run).
    """

    kind: Literal["watch_request"] = "watch_request"
    trigger_id: str = Field(min_length=1, max_length=TRIGGER_ID_MAX)
    classpath: str = Field(min_length=1, description="Import path of the trigger class.")
    kwargs: TaggedDict = Field(
        default_factory=dict, description="Trigger kwargs (empty when sealed)."
    )
    kwargs_token: str | None = Field(
        default=None, min_length=1, description="Fernet token of the tagged-JSON kwargs, if sealed."
    )
    queue: QueueName | None = Field(
        default=None, description="Trigger queue; null is the default queue."
    )
    assets: list[AssetRef] = Field(
        default_factory=list, description="The assets its events feed (informational)."
    )
    once: bool = Field(
        default=False,
        description="One run only: the watch ends with that run's last event or its failure "
        "(tombstoned with it) and is never started again (Airflow's deadline-alert callbacks).",
    )
    requested_at: AwareDatetime = Field(default_factory=utcnow)

    _sealed = field_validator("kwargs_token")(_sealed_kwargs_are_empty)


WatchStatus = Literal["fired", "failed"]


def make_watch_event_id(trigger_id: str, run: str, seq: int) -> str:
    """The id of the ``seq``-th event (from 1) of one run of a watch: ``<trigger id>:<run>:<seq>``.

    ``run`` names one start of the watch's trigger (any member, any restart) and holds no
    ``:``, so the id parses from the right whatever the trigger id holds.
    """
    return f"{trigger_id}:{run}:{seq}"


def source_run(partition: int) -> str:
    """The ``run`` of a watch event read from a Kafka record of ``partition``; its ``seq`` is
    the record's offset + 1, so the same record read again is the same event id."""
    return f"partition-{partition}"


def source_record(run: str, seq: int) -> tuple[int, int] | None:
    """(partition, offset) of the Kafka record a watch event was read from, or None when the
    event is numbered within a run of its trigger instead."""
    partition = run.removeprefix("partition-")
    if partition == run or not partition.isdigit():
        return None
    return int(partition), seq - 1


class WatchEvent(_Record):
    """One event of a standing watch (or the failure of one of its runs); value of the
    resume topic, keyed by ``trigger_id``. The watch goes on either way."""

    kind: Literal["watch_event"] = "watch_event"
    event_id: str = Field(min_length=1, description="make_watch_event_id(trigger_id, run, seq).")
    trigger_id: str = Field(min_length=1)
    run: str = Field(
        min_length=1, max_length=64, pattern=r"^[^:]+$", description="One start of the trigger."
    )
    seq: int = Field(ge=1, description="The event's place within its run, from 1.")
    status: WatchStatus
    payload: Tagged = None
    error: str | None = None
    traceback: str | None = None
    last: bool = Field(
        default=False, description="The run's last event: the trigger returned, or failed."
    )
    emitted_at: AwareDatetime = Field(default_factory=utcnow)
    member: str | None = Field(default=None, description="Consumer-group member that ran it.")
    partition: int | None = None
    queue: QueueName | None = None

    @model_validator(mode="after")
    def _id_names_its_run(self) -> WatchEvent:
        if self.event_id != make_watch_event_id(self.trigger_id, self.run, self.seq):
            raise ValueError("event_id must be make_watch_event_id(trigger_id, run, seq)")
        return self


class LogLine(_Wire):
    """One log line of a trigger, as its logger made it (secrets masked)."""

    at: AwareDatetime
    level: str = Field(min_length=1, max_length=20, description="e.g. info, warning, error.")
    logger: str | None = None
    message: str


class TriggerLogRecord(_Record):
    """Log lines of one trigger, in order, as one triggerer batched them; value of the
    ``trigger.logs`` topic, keyed by ``trigger_id``. Best effort: a line may be lost with its
    triggerer, and ``dropped`` counts those a bound refused before these."""

    kind: Literal["trigger_log"] = "trigger_log"
    trigger_id: str = Field(min_length=1, max_length=TRIGGER_ID_MAX)
    member: str | None = Field(default=None, description="Consumer-group member that ran it.")
    lines: list[LogLine] = Field(default_factory=list)
    dropped: int = Field(
        default=0, ge=0, description="Lines of this trigger dropped (over the bound) before these."
    )


class TaskStateRecord(_Record):
    """The state of a task instance; value of the compacted tasks topic keyed by ``ti_key``."""

    kind: Literal["task_state"] = "task_state"
    task: TaskKey
    state: TaskState
    trigger_id: str | None = None
    defer_seq: int = 0
    next_method: str | None = None
    next_kwargs: TaggedDict | None = None
    event: Tagged = None
    event_id: str | None = None
    reason: str | None = None
    updated_at: AwareDatetime = Field(default_factory=utcnow)
    source: Literal["worker", "scheduler", "triggerer", "client"] = "scheduler"
    resume: ResumeTarget | None = None
    timeout_at: AwareDatetime | None = None
    queue: QueueName | None = None
    xcoms: TaggedDict | None = Field(
        default=None,
        description=(
            'Values the task produced (Airflow XComs): {"return_value": ...} plus any pushed keys.'
        ),
    )


class RunTask(_Record):
    """Work for a worker: start a task, or resume it after its trigger fired."""

    kind: Literal["run_task"] = "run_task"
    task: TaskKey
    mode: Literal["start", "resume"]
    operator: str
    op_kwargs: TaggedDict = Field(default_factory=dict)
    next_method: str | None = None
    next_kwargs: TaggedDict | None = None
    event: Tagged = None
    event_id: str | None = None
    trigger_id: str | None = None
    defer_seq: int = 0
    worker_queue: QueueName = "default"
    pool: str = "default_pool"
    pool_slots: int = Field(default=1, ge=1)
    priority_weight: int = 1
    retries: int = Field(default=0, ge=0)
    enqueued_at: AwareDatetime = Field(default_factory=utcnow)


class DeadLetter(_Record):
    """A message that could not be applied, with where it came from and why."""

    kind: Literal["dead_letter"] = "dead_letter"
    topic: str
    partition: int
    offset: int
    key: WireBytes | None = Field(default=None, description="Original key, base64.")
    value: WireBytes | None = Field(default=None, description="Original value, base64.")
    error: str
    error_type: str
    member: str | None = None
    failed_at: AwareDatetime = Field(default_factory=utcnow)
    trigger_id: str | None = None
    task: TaskKey | None = None


class PoolWant(_Record):
    """A task asks for slots of a limited pool: value of ``want/<ti_key>`` on the pools topic.

    Written by the scheduler owning the task's partition while the task is ``scheduled`` (or
    holds its slots) in a pool with a slot count; tombstoned once it neither holds nor wants
    them. The ledger admits wants in (-priority_weight, scheduled_at, ti_key) order.
    """

    kind: Literal["pool_want"] = "pool_want"
    pool: str = Field(min_length=1)
    slots: int = Field(ge=1, description="Slots the task takes (its pool_slots).")
    priority_weight: int = 1
    scheduled_at: AwareDatetime = Field(description="updated_at of the task's scheduled state.")
    try_number: int = Field(ge=0, description="The attempt that wants the slots.")
    partition: int = Field(ge=0, description="The task's partition of tasks and tasks.events.")
    held: bool = Field(
        default=False,
        description=(
            "The attempt already holds the slots (found queued, running or deferred without a"
            " want, e.g. admitted before the ledger): the ledger counts it at once, even over"
            " the pool's size, and admits nothing new until the pool is below its size."
        ),
    )


class PoolGrant(_Record):
    """Slots of a pool given to one attempt: value of ``grant/<ti_key>`` on the pools topic.

    Written by the ledger owner (the owner of task partition 0) only while the pool's live
    grants plus these slots stay within its size; tombstoned once the matching want is gone
    or superseded, which frees the slots.
    """

    kind: Literal["pool_grant"] = "pool_grant"
    pool: str = Field(min_length=1)
    slots: int = Field(ge=1)
    try_number: int = Field(ge=0)
    partition: int = Field(ge=0, description="The want's partition: who starts the task.")


AnyRecord = (
    DeferRequest
    | CancelRequest
    | TriggerEventRecord
    | TaskStateRecord
    | RunTask
    | DeadLetter
    | PoolWant
    | PoolGrant
    | WatchRequest
    | WatchEvent
    | TriggerLogRecord
)

RECORD_TYPES: dict[str, type[_Record]] = {
    "defer_request": DeferRequest,
    "cancel_request": CancelRequest,
    "trigger_event": TriggerEventRecord,
    "task_state": TaskStateRecord,
    "run_task": RunTask,
    "dead_letter": DeadLetter,
    "pool_want": PoolWant,
    "pool_grant": PoolGrant,
    "watch_request": WatchRequest,
    "watch_event": WatchEvent,
    "trigger_log": TriggerLogRecord,
}
