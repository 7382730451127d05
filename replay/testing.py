"""Internals of deferline.replay for deferline's tests and benchmarks only."""

from ._cli import parse_duration, parse_time
from ._fold import KEEP
from ._render import dump_json, render_stuck, render_timeline, render_verdict

__all__ = [
    "KEEP",
    "dump_json",
    "parse_duration",
    "parse_time",
    "render_stuck",
    "render_timeline",
    "render_verdict",
]
