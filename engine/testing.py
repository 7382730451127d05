"""Internals of deferline.engine for deferline's tests and benchmarks only."""

from ._airflow import to_deferline_event
from ._airflow_services import SharedReads
from ._coroutine_runs import _Run as Run
from ._shared_streams import SharedStreamEnded, SharedStreams
from ._slots import SlotBook
from ._supervisor_state import _AT_DEADLINE as AT_DEADLINE
from ._supervisor_state import _Expiry as Expiry
from ._supervisor_state import _Queued as Queued
from ._supervisor_state import _Timer as Timer
from ._taskstate_checkpoint import FORMAT
from ._taskstate_checkpoint import _Stored as Stored
from ._taskstate_values import _Slim as Slim
from ._taskstate_values import _tagged_value as tagged_value
from ._timer_heap import DeadlineHeap

__all__ = [
    "AT_DEADLINE",
    "FORMAT",
    "DeadlineHeap",
    "Expiry",
    "Queued",
    "Run",
    "SharedReads",
    "SharedStreamEnded",
    "SharedStreams",
    "Slim",
    "SlotBook",
    "Stored",
    "Timer",
    "tagged_value",
    "to_deferline_event",
]
