"""The lifecycle and assignment diff every member shares (triggerer and scheduler)."""

from __future__ import annotations

import pytest
from deferline.runners.member import (
    MOVES,
    IllegalPartitionMove,
    PartitionPhase,
    diff_assignment,
    moved,
)
from deferline.schemas import DeferlineError
from hypothesis import given
from hypothesis import strategies as st

P = PartitionPhase
WRITING = {P.STARTING, P.ACTIVE}


def _reachable(start: PartitionPhase) -> set[PartitionPhase]:
    seen, todo = {start}, [start]
    while todo:
        for to in MOVES[todo.pop()]:
            if to not in seen:
                seen.add(to)
                todo.append(to)
    return seen


def test_a_takeover_can_reach_every_phase_and_every_phase_can_end() -> None:
    assert _reachable(P.ACQUIRING) == set(P)
    assert all(P.GONE in _reachable(phase) for phase in P)
    assert MOVES[P.GONE] == frozenset(), "owning it again is a new lifecycle"


def test_nothing_goes_back_to_a_takeover_or_writes_once_given_up() -> None:
    assert not any(P.ACQUIRING in tos for tos in MOVES.values())
    assert all(P.STARTING not in MOVES[phase] for phase in P if phase is not P.ACQUIRING)
    assert not WRITING & _reachable(P.RELEASING)


def test_a_quiesced_partition_is_kept_released_or_lost_and_nothing_else() -> None:
    assert MOVES[P.QUIESCED] == {P.ACTIVE, P.RELEASING, P.GONE}


@given(st.sampled_from(list(P)), st.sampled_from(list(P)), st.none() | st.integers(0, 99))
def test_a_move_outside_the_table_is_refused_naming_it(
    at: PartitionPhase, to: PartitionPhase, partition: int | None
) -> None:
    if to in MOVES[at]:
        assert moved(partition, at, to) is to
        return
    with pytest.raises(IllegalPartitionMove) as refused:
        moved(partition, at, to)
    assert isinstance(refused.value, DeferlineError)
    which = "a partition" if partition is None else f"partition {partition}"
    assert str(refused.value) == f"{which} cannot go from {at.value} to {to.value}"


@given(st.sets(st.integers(0, 20)), st.sets(st.integers(0, 20)))
def test_only_what_moved_changes_hands(held: set[int], assigned: set[int]) -> None:
    change = diff_assignment(held, assigned)
    assert set(change.kept) | set(change.released) == held
    assert set(change.kept) | set(change.acquired) == assigned
    assert not set(change.kept) & set(change.released)
    assert not set(change.kept) & set(change.acquired)
    for part in (change.kept, change.acquired, change.released):
        assert list(part) == sorted(part)


def test_every_lifecycle_refuses_a_move_with_one_deferline_error() -> None:
    from deferline.runners import IllegalTransition
    from deferline.runners.airflow_bridge import IllegalTransition as BridgeRefusal

    assert issubclass(IllegalPartitionMove, IllegalTransition)
    assert issubclass(IllegalTransition, DeferlineError)
    assert BridgeRefusal is IllegalTransition
