"""Which task partitions this scheduler owns, and in which phase of the lifecycle every
member shares (:mod:`deferline.runners.member`).

No I/O: the shell (:mod:`._scheduler`) moves a partition when the group assigns or revokes
it, when its takeover is done, or when its producer is fenced; the machine refuses a move the
lifecycle does not have, and says whether a partition's decisions may be written now.

Rebalances are eager (every rebalance revokes every partition first), made incremental as
the triggerers' are: a revoked partition is only quiesced (nothing is written for it), and
the next assignment says whether it is kept (active again at once) or gone (dropped).

A scheduler uses four of its phases (gone: the partition is dropped from the table)::

    (assign) ──▶ acquiring ──acquired──▶ active ◀──kept── quiesced
                     │                     │  └──revoke──▶    │
                     └──── revoke, lose ───┴──── lose ────────┴──▶ gone
"""

from __future__ import annotations

from collections.abc import Iterable

from ..member import AssignmentDiff, IllegalPartitionMove, PartitionPhase, diff_assignment, moved

__all__ = ["Ownership"]

_ACQUIRING, _ACTIVE, _QUIESCED, _GONE = (
    PartitionPhase.ACQUIRING,
    PartitionPhase.ACTIVE,
    PartitionPhase.QUIESCED,
    PartitionPhase.GONE,
)


class Ownership:
    """Each owned partition's phase (:class:`PartitionPhase`); the only writer of it."""

    __slots__ = ("_holds",)

    def __init__(self) -> None:
        self._holds: dict[int, PartitionPhase] = {}

    def hold(self, partition: int) -> PartitionPhase | None:
        """The partition's phase; None when it is not owned."""
        return self._holds.get(partition)

    def writable(self, partition: int) -> bool:
        """True when the partition's decisions may be written now."""
        return self._holds.get(partition) is _ACTIVE

    def owned(self, *holds: PartitionPhase) -> list[int]:
        """The partitions held (in one of ``holds``, if given), in order."""
        return sorted(p for p, h in self._holds.items() if not holds or h in holds)

    def _move(self, partition: int, to: PartitionPhase) -> None:
        if moved(partition, self._holds[partition], to) is _GONE:
            del self._holds[partition]
        else:
            self._holds[partition] = to

    def acquired(self, partition: int) -> None:
        """The takeover of an acquiring partition is done: it is active."""
        if self._holds.get(partition) is not _ACQUIRING:
            raise IllegalPartitionMove(f"partition {partition} is not being acquired")
        self._move(partition, _ACTIVE)

    def revoke(self) -> tuple[list[int], list[int]]:
        """Every partition was revoked: active ones quiesce, acquiring ones are released
        (their takeover is abandoned). Returns (quiesced, released)."""
        quiesced = self.owned(_ACTIVE)
        released = self.owned(_ACQUIRING)
        for p in quiesced:
            self._move(p, _QUIESCED)
        for p in released:
            self._move(p, _GONE)
        return quiesced, released

    def assign(self, partitions: Iterable[int]) -> AssignmentDiff:
        """The group assigned ``partitions``: quiesced ones among them are kept, the other
        quiesced ones released, new ones acquiring. IllegalPartitionMove if a partition is
        still active or acquiring (no revocation came first)."""
        busy = self.owned(_ACTIVE, _ACQUIRING)
        if busy:
            raise IllegalPartitionMove(
                f"partitions {busy} were assigned again without a revocation"
            )
        change = diff_assignment(self._holds, partitions)
        for p in change.kept:
            self._move(p, _ACTIVE)
        for p in change.released:
            self._move(p, _GONE)
        for p in change.acquired:
            self._holds[p] = _ACQUIRING  # a lifecycle starts
        return change

    def lose(self, partition: int) -> bool:
        """The partition is lost without a revocation (its producer was fenced: another
        scheduler owns it now): released, whatever its stage. False if it was not owned."""
        if partition not in self._holds:
            return False
        self._move(partition, _GONE)
        return True
