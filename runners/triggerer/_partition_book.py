"""A partition's book in a lane: its phase, the outcomes it holds, the keys it is done with.

The phase follows the lifecycle every member shares (:mod:`deferline.runners.member`):
``acquiring`` while it is rebuilt, ``starting`` while it follows the live tail and its folded
triggers start, ``active``, ``quiesced`` when revoked, ``releasing`` while it is given up
(flush, checkpoint, commit), ``gone``. The book decides what an outcome of one of the
partition's triggers means (emit it, hold it, drop it) and what the next assignment does with
the partition (kept: held outcomes are handed back to be emitted; lost or released: they are
dropped). No I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..member import PartitionPhase, moved

Held = TypeVar("Held")

# Members bound once: an enum member's attribute lookup costs about 80 ns on Python 3.11,
# and an outcome's verdict is on the fire path.
_STARTING, _ACTIVE, _QUIESCED, _RELEASING, _GONE = (
    PartitionPhase.STARTING,
    PartitionPhase.ACTIVE,
    PartitionPhase.QUIESCED,
    PartitionPhase.RELEASING,
    PartitionPhase.GONE,
)


class Verdict(enum.Enum):
    """What to do with an outcome of one of the partition's triggers."""

    EMIT = "emit"
    HOLD = "hold"
    """Quiesced: kept in the book, handed back if the partition is kept."""
    DROP = "drop"
    """Not emitted for (acquiring, releasing, gone): the next owner fires the trigger."""
    REPEAT = "repeat"
    """An event (or tombstone) of this key is already queued: never emit for it again."""


_EMIT, _HOLD, _DROP, _REPEAT = Verdict.EMIT, Verdict.HOLD, Verdict.DROP, Verdict.REPEAT


@dataclass(slots=True, eq=False)
class PartitionBook(Generic[Held]):
    """The phase of one owned partition, the outcomes it holds and the keys it is done with."""

    phase: PartitionPhase = PartitionPhase.ACQUIRING
    quiesced_at: float | None = None
    """When the partition was quiesced (monotonic; None unless quiesced)."""
    held: list[Held] = field(default_factory=list)
    done: set[bytes] = field(default_factory=set)
    """Keys whose event (or tombstone) is produced or queued: never emit for them again."""

    @property
    def emitting(self) -> bool:
        """Its records are applied and its outcomes emitted (starting or active)."""
        phase = self.phase
        return phase is _ACTIVE or phase is _STARTING

    @property
    def owned(self) -> bool:
        """Still owned by the lane (not gone)."""
        return self.phase is not _GONE

    @property
    def ready(self) -> bool:
        """Its rebuild is over (active or quiesced): the table reflects the log it has read."""
        phase = self.phase
        return phase is _ACTIVE or phase is _QUIESCED

    def _move(self, to: PartitionPhase) -> None:
        self.phase = moved(None, self.phase, to)

    def follow(self) -> None:
        """The tail is followed; the folded triggers are about to be started."""
        self._move(PartitionPhase.STARTING)

    def rebuilt(self) -> None:
        """Every folded trigger is started."""
        self._move(PartitionPhase.ACTIVE)

    def quiesce(self, now: float) -> None:
        """Revoked: hold outcomes until the next assignment (again: still quiesced)."""
        if self.phase is not PartitionPhase.QUIESCED:
            self._move(PartitionPhase.QUIESCED)
            self.quiesced_at = now

    def keep(self) -> tuple[list[Held], float | None]:
        """Assigned again: active, and the held outcomes (to emit) and when it was quiesced."""
        if self.phase is PartitionPhase.ACTIVE:
            return [], None
        self._move(PartitionPhase.ACTIVE)
        held, self.held = self.held, []
        since, self.quiesced_at = self.quiesced_at, None
        return held, since

    def release(self) -> bool:
        """Being given up: nothing is emitted from here on (held outcomes are dropped).
        False when it already was (or is gone): the release under way goes on."""
        if self.phase is PartitionPhase.RELEASING or self.phase is PartitionPhase.GONE:
            return False
        self._move(PartitionPhase.RELEASING)
        self.held.clear()
        return True

    def gone(self) -> None:
        """No longer owned (lost, or released; again: still gone): held outcomes dropped."""
        if self.phase is not PartitionPhase.GONE:
            self._move(PartitionPhase.GONE)
            self.held.clear()

    def outcome(self, key: bytes, held: Held) -> Verdict:
        """An outcome of the trigger ``key``: the verdict, with its bookkeeping done (an
        emitted key is done; a held outcome is kept until :meth:`keep` or :meth:`gone`)."""
        phase = self.phase
        if phase is _ACTIVE or phase is _STARTING:
            return _EMIT if self.claim(key) else _REPEAT
        if phase is _QUIESCED:
            self.held.append(held)
            return _HOLD
        return _DROP

    def hold(self, held: Held) -> bool:
        """Keep an outcome that claims no key (a standing watch's event) until :meth:`keep` or
        :meth:`gone`; False unless the partition is quiesced."""
        if self.phase is not _QUIESCED:
            return False
        self.held.append(held)
        return True

    def claim(self, key: bytes) -> bool:
        """Mark ``key`` done (its event or tombstone is being queued); False if it was."""
        done = self.done
        if key in done:
            return False
        done.add(key)
        return True

    def tombstoned(self, key: bytes) -> bool:
        """A tombstone of ``key`` was read: True if it was this lane's own (then forgotten)."""
        if key in self.done:
            self.done.discard(key)
            return True
        return False
