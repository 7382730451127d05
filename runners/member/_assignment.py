"""What a new assignment means for the partitions a member holds (pure)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["AssignmentDiff", "diff_assignment"]


@dataclass(frozen=True, slots=True)
class AssignmentDiff:
    """Partitions in ascending order: ``kept`` (held and assigned again: they carry on where
    they stopped), ``acquired`` (assigned and not held: taken over), ``released`` (held and
    not assigned: given up without writing)."""

    kept: tuple[int, ...]
    acquired: tuple[int, ...]
    released: tuple[int, ...]


def diff_assignment(held: Iterable[int], assigned: Iterable[int]) -> AssignmentDiff:
    """Only what moved changes hands: ``held`` against the group's new ``assigned``."""
    had, mine = set(held), set(assigned)
    return AssignmentDiff(
        kept=tuple(sorted(had & mine)),
        acquired=tuple(sorted(mine - had)),
        released=tuple(sorted(had - mine)),
    )
