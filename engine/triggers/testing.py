"""Internals of deferline.engine.triggers for deferline's tests and benchmarks only."""

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
