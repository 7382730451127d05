"""Wire contract: versioned records, the tagged value codec and kwargs encryption. No I/O."""

from ._codec import canonical_json, dumps_kept, dumps_value, from_tagged, loads_value, to_tagged
from ._crypto import KwargsCipher, open_kwargs, seal
from ._deferral import DeferFields, decode_deferral
from ._errors import (
    DecryptionError,
    DeferlineError,
    InvalidKwargsKey,
    SchemaError,
    UnknownSchemaVersion,
)
from ._jsonschema import record_json_schemas, rendered_json_schemas
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
    "AnyRecord",
    "CancelRequest",
    "DeadLetter",
    "DecryptionError",
    "DeferFields",
    "DeferRequest",
    "DeferlineError",
    "EventStatus",
    "InvalidKwargsKey",
    "KwargsCipher",
    "ResumeTarget",
    "RunTask",
    "SchemaError",
    "TaskKey",
    "TaskOutcome",
    "TaskState",
    "TaskStateRecord",
    "TriggerEventRecord",
    "UnknownSchemaVersion",
    "canonical_json",
    "decode",
    "decode_as",
    "decode_deferral",
    "dumps_kept",
    "dumps_value",
    "encode",
    "from_tagged",
    "loads_value",
    "make_event_id",
    "make_trigger_id",
    "open_kwargs",
    "record_json_schemas",
    "rendered_json_schemas",
    "seal",
    "to_tagged",
    "utcnow",
]
