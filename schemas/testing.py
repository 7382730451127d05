"""Internals exposed for deferline's own tests and benchmarks.

Not part of the public API: no compatibility promise; names here move or go without notice.
"""

from ._deferral import quick_defer_fields
from ._event import quick_event_fields
from ._models import WIRE_CONTEXT, _Record

__all__ = [
    "WIRE_CONTEXT",
    "_Record",
    "quick_defer_fields",
    "quick_event_fields",
]
