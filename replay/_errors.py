"""Errors of the replay tools."""

from __future__ import annotations

from deferline.schemas import DeferlineError

__all__ = ["BadSubject", "RedriveRefused", "ReplayError", "TopicsNotFound"]


class ReplayError(DeferlineError):
    """Reading the topics back failed."""


class BadSubject(ReplayError):
    """A task key or trigger id given to a replay command could not be parsed."""


class TopicsNotFound(ReplayError):
    """No deferline topic with the configured prefix exists on the cluster."""


class RedriveRefused(ReplayError):
    """A trigger cannot be re-driven safely (the reason says why)."""
