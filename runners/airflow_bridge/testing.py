"""Internals exposed for deferline's own tests and benchmarks.

Not part of the public API: no compatibility promise; names here move or go without notice.
"""

from ._airflow_db import AirflowDatabase
from ._book import RowBook
from ._rendering import has_template
from ._rows import (
    BridgeEvent,
    ClaimedRow,
    KwargsNotRendered,
    RejectedRow,
    RowRef,
    bridge_event,
    read_event,
    to_defer_request,
)
from ._state import _MOVES
from ._write_back import CleanUpSchedule, write_back_loop

__all__ = [
    "_MOVES",
    "AirflowDatabase",
    "BridgeEvent",
    "ClaimedRow",
    "CleanUpSchedule",
    "KwargsNotRendered",
    "RejectedRow",
    "RowBook",
    "RowRef",
    "bridge_event",
    "has_template",
    "read_event",
    "to_defer_request",
    "write_back_loop",
]
