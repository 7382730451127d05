"""Internals exposed for deferline's own tests and benchmarks.

Not part of the public API: no compatibility promise; names here move or go without notice.
"""

from ._file import find_file
from ._http import parse_json_path, resolve_json_path
from ._kafka import decode_value, json_contains

__all__ = [
    "decode_value",
    "find_file",
    "json_contains",
    "parse_json_path",
    "resolve_json_path",
]
