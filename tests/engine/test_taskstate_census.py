"""The table's state counts and overdue deferrals, kept as it changes, are those a walk of
the whole table finds, through folds, forgets, partition drops, absorbs and restores."""

from __future__ import annotations

import random

from deferline.engine import Pools, TaskTable
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.test_taskstate import _KINDS, _World, at, key, scheduled


def _walked(table: TaskTable, ticks: range) -> tuple[dict[str, int], list[int]]:
    counts: dict[str, int] = {}
    for view in table._views.values():
        counts[view.record.state] = counts.get(view.record.state, 0) + 1
    overdue = [
        sum(
            1
            for view in table._views.values()
            if view.record.state == "deferred"
            and view.record.timeout_at is not None
            and view.record.timeout_at < at(tick)
        )
        for tick in ticks
    ]
    return counts, overdue


def _kept(table: TaskTable, ticks: range) -> tuple[dict[str, int], list[int]]:
    return table.count_by_state(), [table.overdue_deferrals(at(tick)) for tick in ticks]


@settings(max_examples=60, deadline=None)
@given(
    scripts=st.lists(st.lists(_KINDS, max_size=4), min_size=1, max_size=6),
    dups=st.integers(0, 1),
    seed=st.integers(0, 2**32),
)
def test_counts_and_overdue_deferrals_are_those_of_a_walk(
    scripts: list[list[str]], dups: int, seed: int
) -> None:
    world = _World(
        rng=random.Random(seed),
        scripts={key(n).ti_key: script for n, script in enumerate(scripts)},
        dups=dups,
        pools=Pools(slots={"default_pool": 2}),
        timeouts=True,
    )
    for n in range(len(scripts)):
        world.tasks_log.append(scheduled(key(n), world.tick))
    while world.step_once():
        ticks = range(max(0, world.tick - 3), world.tick + 12, 2)  # some times go back
        assert _kept(world.table, ticks) == _walked(world.table, ticks)
    ticks = range(0, world.tick + 12)
    table = world.table
    table.forget_finished(0)
    assert _kept(table, ticks) == _walked(table, ticks)
    # A partition dropped, then the rest absorbed into another table.
    odd = table.drop_where(lambda ti_key: int(ti_key.split("/")[1][1:]) % 2 == 1)
    assert _kept(table, ticks) == _walked(table, ticks)
    other = TaskTable(pools=world.pools)
    other.absorb(table)
    assert _kept(other, ticks) == _walked(other, ticks)
    assert _kept(table, ticks) == ({}, [0] * len(ticks))
    assert sum(other.count_by_state().values()) == len(other) > 0 or not odd


def test_the_deadlines_of_ended_deferrals_do_not_pile_up() -> None:
    """A task deferred 3,000 times in turn, with no scrape between: the deadlines of its
    ended deferrals are dropped once they outnumber the live ones."""
    table = TaskTable()
    census = table._census
    world = _World(
        rng=random.Random(1),
        scripts={key(1).ti_key: ["fired"] * 3000},
        dups=0,
        pools=Pools(),
        timeouts=True,
    )
    world.table = table
    world.tasks_log.append(scheduled(key(1), 0))
    most = 0
    while world.step_once():
        most = max(most, len(census._deadlines))
    assert world.step[key(1).ti_key] == 3000  # 3,000 deferrals, one at a time
    assert most <= 2 * 1 + 1024  # the ended ones dropped: one live at most
    assert census._timed == 0
    assert table.overdue_deferrals(at(10**6)) == 0
