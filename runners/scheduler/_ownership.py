"""Which task partitions this scheduler owns, and in which stage: one explicit state machine.

No I/O: the shell (:mod:`._scheduler`) moves a partition when the group assigns or revokes
it, when its takeover is done, or when its producer is fenced; the machine refuses a move the
lifecycle does not have, and says whether a partition's decisions may be written now.

Rebalances are eager (every rebalance revokes every partition first), made incremental as
the triggerers' are: a revoked partition is only quiesced (nothing is written for it), and
the next assignment says whether it is kept (active again at once) or gone (dropped).

::

    (absent) ──assign──▶ ACQUIRING ──acquired──▶ ACTIVE ◀──keep── QUIESCED
                             │                     │  └──revoke──▶    │
                             └────────── release ──┴──────────────────┴──▶ (absent)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Hold", "IllegalMove", "Ownership", "Rebalance"]


class Hold(enum.Enum):
    ACQUIRING = "acquiring"  # fencing the old owner, folding the partition: writes nothing
    ACTIVE = "active"  # folds the partition's events and writes its decisions
    QUIESCED = "quiesced"  # revoked: writes nothing until the next assignment says kept/gone


_MOVES: dict[Hold | None, frozenset[Hold | None]] = {
    None: frozenset({Hold.ACQUIRING}),
    Hold.ACQUIRING: frozenset({Hold.ACTIVE, None}),
    Hold.ACTIVE: frozenset({Hold.QUIESCED, None}),
    Hold.QUIESCED: frozenset({Hold.ACTIVE, None}),
}


class IllegalMove(ValueError):
    """A partition was asked for a move its lifecycle does not have."""


@dataclass(frozen=True, slots=True)
class Rebalance:
    """What an assignment means for the partitions held: kept (active again), acquired (to
    take over), released (to drop, without writing)."""

    kept: tuple[int, ...]
    acquired: tuple[int, ...]
    released: tuple[int, ...]


class Ownership:
    """Each owned partition's :class:`Hold`; the only writer of it."""

    __slots__ = ("_holds",)

    def __init__(self) -> None:
        self._holds: dict[int, Hold] = {}

    def hold(self, partition: int) -> Hold | None:
        """The partition's stage; None when it is not owned."""
        return self._holds.get(partition)

    def writable(self, partition: int) -> bool:
        """True when the partition's decisions may be written now."""
        return self._holds.get(partition) is Hold.ACTIVE

    def owned(self, *holds: Hold) -> list[int]:
        """The partitions held (in one of ``holds``, if given), in order."""
        return sorted(p for p, h in self._holds.items() if not holds or h in holds)

    def _move(self, partition: int, to: Hold | None) -> None:
        at = self._holds.get(partition)
        if to not in _MOVES[at]:
            were = at.value if at is not None else "not owned"
            goes = to.value if to is not None else "released"
            raise IllegalMove(f"partition {partition} cannot go from {were} to {goes}")
        if to is None:
            del self._holds[partition]
        else:
            self._holds[partition] = to

    def acquired(self, partition: int) -> None:
        """The takeover of an acquiring partition is done: it is active."""
        if self._holds.get(partition) is not Hold.ACQUIRING:
            raise IllegalMove(f"partition {partition} is not being acquired")
        self._move(partition, Hold.ACTIVE)

    def revoke(self) -> tuple[list[int], list[int]]:
        """Every partition was revoked: active ones quiesce, acquiring ones are released
        (their takeover is abandoned). Returns (quiesced, released)."""
        quiesced = self.owned(Hold.ACTIVE)
        released = self.owned(Hold.ACQUIRING)
        for p in quiesced:
            self._move(p, Hold.QUIESCED)
        for p in released:
            self._move(p, None)
        return quiesced, released

    def assign(self, partitions: Iterable[int]) -> Rebalance:
        """The group assigned ``partitions``: quiesced ones among them are kept, the other
        quiesced ones released, new ones acquiring. IllegalMove if a partition is still
        active or acquiring (no revocation came first)."""
        mine = set(partitions)
        busy = self.owned(Hold.ACTIVE, Hold.ACQUIRING)
        if busy:
            raise IllegalMove(f"partitions {busy} were assigned again without a revocation")
        quiesced = self.owned(Hold.QUIESCED)
        kept = tuple(p for p in quiesced if p in mine)
        released = tuple(p for p in quiesced if p not in mine)
        acquired = tuple(sorted(mine - set(quiesced)))
        for p in kept:
            self._move(p, Hold.ACTIVE)
        for p in released:
            self._move(p, None)
        for p in acquired:
            self._move(p, Hold.ACQUIRING)
        return Rebalance(kept, acquired, released)

    def lose(self, partition: int) -> bool:
        """The partition is lost without a revocation (its producer was fenced: another
        scheduler owns it now): released, whatever its stage. False if it was not owned."""
        if partition not in self._holds:
            return False
        self._move(partition, None)
        return True
