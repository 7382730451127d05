"""The trigger engine: the trigger contract, the loader and the supervisor that runs triggers.

Pure asyncio logic; Kafka reaches it only through the runners. Built-in triggers live in
:mod:`deferline.engine.triggers`.
"""

from ._airflow import preload_airflow, prepare_airflow_import
from ._errors import (
    AirflowDatabaseUnavailable,
    SupervisorError,
    TriggerImportError,
    TriggerKwargsError,
    TriggerLoadError,
    TriggerNotAllowed,
)
from ._loader import is_allowed, load_trigger, resolve_trigger_class
from ._metrics import LagHistogram, SupervisorMetrics
from ._outcome import OutcomeStatus, TriggerOutcome
from ._supervisor import TriggerSupervisor
from ._trigger import (
    BaseTaskEndEvent,
    BaseTrigger,
    TaskFailedEvent,
    TaskFailureEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
    TimerSpec,
    TriggerEvent,
)
from ._watchdog import BlockedLoop

__all__ = [
    "AirflowDatabaseUnavailable",
    "BaseTaskEndEvent",
    "BaseTrigger",
    "BlockedLoop",
    "LagHistogram",
    "OutcomeStatus",
    "SupervisorError",
    "SupervisorMetrics",
    "TaskFailedEvent",
    "TaskFailureEvent",
    "TaskSkippedEvent",
    "TaskSuccessEvent",
    "TimerSpec",
    "TriggerEvent",
    "TriggerImportError",
    "TriggerKwargsError",
    "TriggerLoadError",
    "TriggerNotAllowed",
    "TriggerOutcome",
    "TriggerSupervisor",
    "is_allowed",
    "load_trigger",
    "preload_airflow",
    "prepare_airflow_import",
    "resolve_trigger_class",
]

# --- Operator API and task state machine (engine/_operator.py, engine/_taskstate.py) -----
# Their imports and an `__all__ += [...]` go in this section.

# Operator API (engine/_operator.py).
from ._operator import (
    BaseOperator,
    BaseSensorOperator,
    Context,
    Deferred,
    Failed,
    OperatorError,
    OperatorImportError,
    OperatorKwargsError,
    OperatorLoadError,
    OperatorNotAllowed,
    OperatorResult,
    SensorTimeout,
    SerializableTrigger,
    SerializedTrigger,
    Skipped,
    StartTriggerArgs,
    Succeeded,
    TaskDeferralError,
    TaskDeferralTimeout,
    TaskDeferred,
    TaskSkipped,
    deferral_records,
    import_operator,
    load_operator,
    make_context,
    run_operator,
    start_deferral,
)

# Task state machine and event dedup (engine/_taskstate.py).
from ._taskstate import (
    FAIL_METHOD,
    HOLDING_STATES,
    TERMINAL_STATES,
    Emit,
    Pools,
    TableCounters,
    TaskTable,
    Verdict,
    progress,
)

__all__ += [
    "FAIL_METHOD",
    "HOLDING_STATES",
    "TERMINAL_STATES",
    "Emit",
    "Pools",
    "TableCounters",
    "TaskTable",
    "Verdict",
    "progress",
]

# Operator API (engine/_operator.py).
__all__ += [
    "BaseOperator",
    "BaseSensorOperator",
    "Context",
    "Deferred",
    "Failed",
    "OperatorError",
    "OperatorImportError",
    "OperatorKwargsError",
    "OperatorLoadError",
    "OperatorNotAllowed",
    "OperatorResult",
    "SensorTimeout",
    "SerializableTrigger",
    "SerializedTrigger",
    "Skipped",
    "StartTriggerArgs",
    "Succeeded",
    "TaskDeferralError",
    "TaskDeferralTimeout",
    "TaskDeferred",
    "TaskSkipped",
    "deferral_records",
    "import_operator",
    "load_operator",
    "make_context",
    "run_operator",
    "start_deferral",
]
