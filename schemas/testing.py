"""Internals of deferline.schemas for deferline's tests and benchmarks only."""

from ._deferral import quick_defer_fields
from ._event import quick_event_fields
from ._models import WIRE_CONTEXT
from ._models import _Record as Record

__all__ = [
    "WIRE_CONTEXT",
    "Record",
    "quick_defer_fields",
    "quick_event_fields",
]
