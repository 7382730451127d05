"""How every lifecycle in the runners refuses a move its transition table does not have."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Set
from typing import TypeVar

from deferline.schemas import DeferlineError

__all__ = ["IllegalTransition", "checked"]

S = TypeVar("S", bound=enum.Enum)


class IllegalTransition(DeferlineError):
    """A lifecycle was asked for a move its transition table does not have (a bug in the
    code that asked)."""


def checked(
    what: str,
    moves: Mapping[S, Set[S]],
    at: S,
    to: S,
    refusal: type[IllegalTransition] = IllegalTransition,
) -> S:
    """``to``, if ``what`` may go there from ``at``; else ``refusal`` naming both."""
    if to not in moves[at]:
        raise refusal(f"{what} cannot go from {at.value} to {to.value}")
    return to
