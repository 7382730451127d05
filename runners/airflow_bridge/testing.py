"""Internals of deferline.runners.airflow_bridge for deferline's tests and benchmarks only."""

from ._airflow_db import AirflowDatabase
from ._book import RowBook
from ._rendering import has_template
from ._rows import (
    BridgeEvent,
    ClaimedRow,
    KwargsNotRendered,
    RejectedRow,
    RowRef,
    WatchApply,
    WatchRow,
    bridge_event,
    read_event,
    to_defer_request,
    to_watch_request,
)
from ._state import _MOVES as MOVES
from ._trigger_logs import TriggerLogFiles
from ._write_back import CleanUpSchedule, write_back_loop

__all__ = [
    "MOVES",
    "AirflowDatabase",
    "BridgeEvent",
    "ClaimedRow",
    "CleanUpSchedule",
    "KwargsNotRendered",
    "RejectedRow",
    "RowBook",
    "RowRef",
    "TriggerLogFiles",
    "WatchApply",
    "WatchRow",
    "bridge_event",
    "has_template",
    "read_event",
    "to_defer_request",
    "to_watch_request",
    "write_back_loop",
]
