"""A partition's lifecycle in a member of a consumer group: one phase, one transition table.

Triggerers own partitions of the defer topic, schedulers partitions of the tasks topic, and
both own them the same way. What a member does in a phase is its own; where a partition may
go next is not::

    acquiring ──▶ starting ──▶ active ──▶ quiesced ──▶ active     (kept)
        │            │  ▲        │           └───────▶ gone       (released or lost)
        ├────────────┼──┘        │
        └────────────┴───────────┴──▶ releasing ───▶ gone

- ``acquiring``: taken over (the old owner fenced, the partition rebuilt from its checkpoint
  and the topics); nothing is written for it.
- ``starting``: follows the live tail while what was rebuilt starts (a triggerer's folded
  triggers); written for.
- ``active``: read and written for.
- ``quiesced``: revoked; nothing is written until the next assignment says kept or gone.
- ``releasing``: being given up (flush, checkpoint, commit); nothing more is written.
- ``gone``: no longer owned, for good (owning it again is a new lifecycle).

Any phase but ``releasing`` may also go straight to ``gone``: lost (fenced, or assigned
elsewhere), or a takeover abandoned. A member with nothing to start moves ``acquiring`` to
``active`` directly.
"""

from __future__ import annotations

import enum

from .._transitions import IllegalTransition, checked

__all__ = ["MOVES", "IllegalPartitionMove", "PartitionPhase", "moved"]


class PartitionPhase(enum.Enum):
    """Where an owned partition is in its lifecycle."""

    ACQUIRING = "acquiring"
    STARTING = "starting"
    ACTIVE = "active"
    QUIESCED = "quiesced"
    RELEASING = "releasing"
    GONE = "gone"


_P = PartitionPhase
MOVES: dict[PartitionPhase, frozenset[PartitionPhase]] = {
    _P.ACQUIRING: frozenset({_P.STARTING, _P.ACTIVE, _P.RELEASING, _P.GONE}),
    _P.STARTING: frozenset({_P.ACTIVE, _P.RELEASING, _P.GONE}),
    _P.ACTIVE: frozenset({_P.QUIESCED, _P.RELEASING, _P.GONE}),
    _P.QUIESCED: frozenset({_P.ACTIVE, _P.RELEASING, _P.GONE}),
    _P.RELEASING: frozenset({_P.GONE}),
    _P.GONE: frozenset(),
}


class IllegalPartitionMove(IllegalTransition):
    """A partition was asked for a move its lifecycle does not have (a bug in the member)."""


def moved(partition: int | None, at: PartitionPhase, to: PartitionPhase) -> PartitionPhase:
    """``to``, if a partition in ``at`` may go there; else IllegalPartitionMove naming both."""
    which = "a partition" if partition is None else f"partition {partition}"
    return checked(which, MOVES, at, to, IllegalPartitionMove)
