"""Wire contract: versioned records, the tagged value codec and kwargs encryption. No I/O."""

from ._codec import dumps_value, from_tagged, loads_value, to_tagged
from ._errors import DecryptionError, DeferlineError, SchemaError, UnknownSchemaVersion
from ._models import (
    RECORD_TYPES,
    SCHEMA_VERSION,
    AnyRecord,
    CancelRequest,
    DeadLetter,
    DeferRequest,
    EventStatus,
    ResumeTarget,
    RunTask,
    TaskKey,
    TaskOutcome,
    TaskState,
    TaskStateRecord,
    TriggerEventRecord,
    make_event_id,
    make_trigger_id,
    utcnow,
)
from ._wire import decode, decode_as, encode

__all__ = [
    "RECORD_TYPES",
    "SCHEMA_VERSION",
    # Records
    "AnyRecord",
    "CancelRequest",
    "DeadLetter",
    # Errors
    "DecryptionError",
    "DeferRequest",
    "DeferlineError",
    "EventStatus",
    "ResumeTarget",
    "RunTask",
    "SchemaError",
    "TaskKey",
    "TaskOutcome",
    "TaskState",
    "TaskStateRecord",
    "TriggerEventRecord",
    "UnknownSchemaVersion",
    # Wire
    "decode",
    "decode_as",
    # Values
    "dumps_value",
    "encode",
    "from_tagged",
    "loads_value",
    "make_event_id",
    "make_trigger_id",
    "to_tagged",
    "utcnow",
]
