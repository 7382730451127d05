"""The trigger engine: the trigger contract, its loader and supervisor, the operator API
and the task state machine.

Pure asyncio logic; Kafka reaches it only through the runners. Built-in triggers live in
:mod:`deferline.engine.triggers`.
"""

from ._airflow import (
    close_airflow_services,
    preload_airflow,
    prepare_airflow_import,
    redact_secrets,
    use_airflow_services,
    watch_assets,
)
from ._airflow_support import (
    KNOWN_BREAKS,
    KnownBreak,
    airflow_environment_problems,
    check_airflow_environment,
)
from ._errors import (
    AirflowDatabaseUnavailable,
    AirflowEnvironmentError,
    AirflowServicesUnavailable,
    SupervisorError,
    TriggerImportError,
    TriggerKwargsError,
    TriggerLoadError,
    TriggerNotAllowed,
)
from ._loader import is_allowed, load_trigger, resolve_trigger_class
from ._metrics import LagHistogram, SupervisorMetrics
from ._operator import (
    BaseOperator,
    BaseSensorOperator,
    Context,
    OperatorError,
    OperatorImportError,
    OperatorKwargsError,
    OperatorLoadError,
    OperatorNotAllowed,
    SensorTimeout,
    SerializableTrigger,
    SerializedTrigger,
    StartTriggerArgs,
    TaskDeferralError,
    TaskDeferralTimeout,
    TaskDeferred,
    TaskSkipped,
    make_context,
)
from ._operator_run import (
    Deferred,
    Failed,
    OperatorResult,
    Skipped,
    Succeeded,
    deferral_records,
    import_operator,
    load_operator,
    run_operator,
    start_deferral,
)
from ._outcome import OutcomeStatus, TriggerOutcome
from ._pool_claims import LedgerAdmission, PoolClaims
from ._pool_ledger import PoolEntry, PoolLedger, grant_matches
from ._supervisor import TriggerSupervisor
from ._supervisor_state import current_trigger_id
from ._task_pools import Pools
from ._taskstate import TaskTable
from ._taskstate_checkpoint import TableDelta, TableRows
from ._taskstate_values import (
    FAIL_METHOD,
    HOLDING_STATES,
    TERMINAL_STATES,
    Emit,
    TableCounters,
    Verdict,
    WrittenState,
    progress,
)
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
    "FAIL_METHOD",
    "HOLDING_STATES",
    "KNOWN_BREAKS",
    "TERMINAL_STATES",
    "AirflowDatabaseUnavailable",
    "AirflowEnvironmentError",
    "AirflowServicesUnavailable",
    "BaseOperator",
    "BaseSensorOperator",
    "BaseTaskEndEvent",
    "BaseTrigger",
    "BlockedLoop",
    "Context",
    "Deferred",
    "Emit",
    "Failed",
    "KnownBreak",
    "LagHistogram",
    "LedgerAdmission",
    "OperatorError",
    "OperatorImportError",
    "OperatorKwargsError",
    "OperatorLoadError",
    "OperatorNotAllowed",
    "OperatorResult",
    "OutcomeStatus",
    "PoolClaims",
    "PoolEntry",
    "PoolLedger",
    "Pools",
    "SensorTimeout",
    "SerializableTrigger",
    "SerializedTrigger",
    "Skipped",
    "StartTriggerArgs",
    "Succeeded",
    "SupervisorError",
    "SupervisorMetrics",
    "TableCounters",
    "TableDelta",
    "TableRows",
    "TaskDeferralError",
    "TaskDeferralTimeout",
    "TaskDeferred",
    "TaskFailedEvent",
    "TaskFailureEvent",
    "TaskSkipped",
    "TaskSkippedEvent",
    "TaskSuccessEvent",
    "TaskTable",
    "TimerSpec",
    "TriggerEvent",
    "TriggerImportError",
    "TriggerKwargsError",
    "TriggerLoadError",
    "TriggerNotAllowed",
    "TriggerOutcome",
    "TriggerSupervisor",
    "Verdict",
    "WrittenState",
    "airflow_environment_problems",
    "check_airflow_environment",
    "close_airflow_services",
    "current_trigger_id",
    "deferral_records",
    "grant_matches",
    "import_operator",
    "is_allowed",
    "load_operator",
    "load_trigger",
    "make_context",
    "preload_airflow",
    "prepare_airflow_import",
    "progress",
    "redact_secrets",
    "resolve_trigger_class",
    "run_operator",
    "start_deferral",
    "use_airflow_services",
    "watch_assets",
]
