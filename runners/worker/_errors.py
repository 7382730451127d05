"""The worker's error."""

from __future__ import annotations

from deferline.schemas import DeferlineError

__all__ = ["WorkerError"]


class WorkerError(DeferlineError):
    """The worker could not read its queues or publish an outcome."""
