"""Internals of deferline.runners.member for deferline's tests and benchmarks only."""

from ._sticky_assignor import balanced_sticky

__all__ = ["balanced_sticky"]
