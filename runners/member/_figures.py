"""What a member counts of its membership, whichever role it plays: one object per member.

Each figure is counted in one place, where the thing happens: a rebalance by the member's
:class:`~._listener.MemberListener`, a round by its :class:`~._producer.MemberProducer`, a
takeover or a fenced partition by the role's partition processor (which alone knows when a
takeover is done, and which partitions it held). The role's metrics read them
(:class:`~._metrics.MemberCollector`).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["MemberFigures"]


def _nothing_owned() -> int:
    return 0


class MemberFigures:
    """One member's membership figures, counted through its methods only.

    Args:
        owned: how many partitions the member owns now, read at each look: the role's own
            count (a triggerer lane counts every partition it holds, a scheduler those it
            writes for), kept where its partitions are rather than copied here.
    """

    __slots__ = (
        "_owned",
        "fenced_rounds",
        "partitions_fenced",
        "rebalances",
        "rounds",
        "takeover_seconds",
        "takeovers",
    )

    def __init__(self, *, owned: Callable[[], int] = _nothing_owned) -> None:
        self._owned = owned
        self.rebalances = 0
        """Assignments received (one per rebalance)."""
        self.takeovers = 0
        """Partitions taken over: acquired, and written for once the takeover was done."""
        self.takeover_seconds: float | None = None
        """How long the last takeover took (None: none yet)."""
        self.partitions_fenced = 0
        """Partitions dropped because the group refused a round holding their writes."""
        self.rounds = 0
        """Transactions the member's producer committed (one per round)."""
        self.fenced_rounds = 0
        """Rounds the group refused, or the broker aborted after their transaction timeout."""

    @property
    def owned(self) -> int:
        """Partitions the member owns now (see ``owned`` above)."""
        return self._owned()

    def assigned(self) -> None:
        """The group assigned the member its partitions (a rebalance)."""
        self.rebalances += 1

    def took_over(self, partitions: int, seconds: float) -> None:
        """A takeover of ``partitions`` partitions is done; it took ``seconds``."""
        self.takeovers += partitions
        self.takeover_seconds = seconds

    def fenced(self, partitions: int) -> None:
        """``partitions`` partitions were dropped: the group refused a round of theirs."""
        self.partitions_fenced += partitions

    def round_committed(self) -> None:
        """The member's producer committed a round."""
        self.rounds += 1

    def round_fenced(self) -> None:
        """A round was refused by the group, or aborted by the broker as timed out."""
        self.fenced_rounds += 1
