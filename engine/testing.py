"""Internals exposed for deferline's own tests and benchmarks.

Not part of the public API: no compatibility promise; names here move or go without notice.
"""

from ._airflow import to_deferline_event
from ._airflow_services import SharedReads
from ._coroutine_runs import _Run
from ._slots import SlotBook
from ._supervisor_state import _AT_DEADLINE, _Expiry, _Queued, _Timer
from ._taskstate_checkpoint import FORMAT, _Stored
from ._taskstate_values import _Slim, _tagged_value
from ._timer_heap import DeadlineHeap

__all__ = [
    "FORMAT",
    "_AT_DEADLINE",
    "DeadlineHeap",
    "SharedReads",
    "SlotBook",
    "_Expiry",
    "_Queued",
    "_Run",
    "_Slim",
    "_Stored",
    "_Timer",
    "_tagged_value",
    "to_deferline_event",
]
