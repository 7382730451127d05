"""The scheduler's pure parts, by property: the fold (own writes read back without decoding
fold as if decoded; unreadable records change nothing), the checkpoint cut by tasks
partition and restored whole, and the lifecycle's moves."""

from __future__ import annotations

import datetime as dt
import itertools
from typing import Any

import pytest
from deferline.engine import LedgerAdmission, Pools, TaskTable
from deferline.runners import IllegalTransition
from deferline.runners.scheduler.testing import (
    Phase,
    PhaseMachine,
    TaskFold,
    merge_states,
    split_delta,
    waves,
)
from deferline.schemas import (
    ResumeTarget,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    encode,
    make_event_id,
    make_trigger_id,
)
from deferline.topics import TopicNames, partition_for
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
NAMES = TopicNames("p.")


def _task(i: int) -> TaskKey:
    return TaskKey(dag_id="d", task_id=f"t{i}", run_id="r")


@st.composite
def records(draw: st.DrawFn) -> tuple[str, int, object]:
    """One input: a task state, a trigger event, a tombstone or unreadable bytes."""
    i = draw(st.integers(0, 5))
    task = _task(i)
    kind = draw(
        st.sampled_from(["scheduled", "deferred", "running", "success", "event", "gone", "bad"])
    )
    at = T0 + dt.timedelta(seconds=draw(st.integers(0, 100)))
    pool = draw(st.sampled_from(["a", "b"]))
    if kind == "scheduled":
        target = ResumeTarget(operator="x.Op", pool=pool)
        return (
            "task",
            i,
            TaskStateRecord(
                task=task, state="scheduled", source="client", resume=target, updated_at=at
            ),
        )
    if kind == "deferred":
        return (
            "task",
            i,
            TaskStateRecord(
                task=task,
                state="deferred",
                source="worker",
                trigger_id=make_trigger_id(task, 0),
                next_method="done",
                resume=ResumeTarget(operator="x.Op", pool=pool),
                updated_at=at,
            ),
        )
    if kind in ("running", "success"):
        return "task", i, TaskStateRecord(task=task, state=kind, source="worker", updated_at=at)
    if kind == "event":
        trigger_id = make_trigger_id(task, 0)
        return (
            "event",
            i,
            TriggerEventRecord(
                event_id=make_event_id(trigger_id, "fired", None),
                trigger_id=trigger_id,
                task=task,
                status="fired",
            ),
        )
    if kind == "gone":
        return "task", i, None  # a tombstone
    return "task", i, draw(st.sampled_from([b"{not json", b"[]"]))


def _feed(fold: TaskFold, inputs: list[tuple[str, int, object]], *, echo: bool) -> list[str]:
    """Fold each input, publish what it decides and read its task states back (without
    decoding when ``echo``); the decisions, in order."""
    decided: list[str] = []
    for kind, i, record in inputs:
        key = _task(i).ti_key.encode()
        if kind == "event":
            assert isinstance(record, TriggerEventRecord)
            fold.event(encode(record), ref=("resume", len(decided)))
        elif isinstance(record, TaskStateRecord):
            fold.task(key, encode(record), live=True)
        else:
            assert record is None or isinstance(record, bytes)
            fold.task(key, record, live=True)
        out = fold.drain()
        decided += [encode(emit.record).decode() for emit in out]
        _, states, _ = waves(NAMES, out, written=fold.written if echo else None)
        for _, state_key, value in states:
            fold.task(state_key, value, live=True)
    return decided


class FoldMachine(RuleBasedStateMachine):
    """Two folds fed the same records: one reads its own writes back from its cache, the
    other decodes them. They decide the same and hold the same table; and the table cut
    into per-partition checkpoints restores whole, whatever the partition count."""

    def __init__(self) -> None:
        super().__init__()
        pools = Pools(slots={"a": 1, "b": 2})
        self.echoed, self.decoded = TaskFold(pools), TaskFold(pools)
        self.echoed.table.track_changes()
        self.checkpoint: dict[int, dict[bytes, bytes]] = {}  # partition: rows
        self.states: dict[int, dict[str, Any]] = {}
        self.partitions = 1

    @rule(inputs=st.lists(records(), min_size=1, max_size=5))
    def fold(self, inputs: list[tuple[str, int, object]]) -> None:
        assert _feed(self.echoed, inputs, echo=True) == _feed(self.decoded, inputs, echo=False)

    @rule(partitions=st.integers(1, 8))
    def repartition(self, partitions: int) -> None:
        """Start the checkpoint over with another partition count (every task changed)."""
        self.partitions = partitions
        self.checkpoint, self.states = {}, {}
        self.echoed.table.track_changes()

    @rule()
    def write_checkpoint(self) -> None:
        parts = split_delta(self.echoed.table.export_changes(), self.partitions)
        for p, part in parts.items():
            assert {partition_for(key.encode(), self.partitions) for key in part.keys} <= {p}
            rows = part.encode()
            stored = self.checkpoint.setdefault(p, {})
            for key in rows.deletes:
                stored.pop(key, None)
            stored.update(rows.rows)
            self.states[p] = rows.state

    @invariant()
    def same_table(self) -> None:
        assert self.echoed.table.snapshot() == self.decoded.table.snapshot()
        assert self.echoed.table.pool_usage() == self.decoded.table.pool_usage()
        assert self.echoed.written == {}, "every own write was read back"

    @precondition(lambda self: self.states)
    @rule()
    def restore_checkpoint(self) -> None:
        self.write_checkpoint()
        restored = TaskTable(pools=self.echoed.table.pools)
        rows = itertools.chain.from_iterable(part.items() for part in self.checkpoint.values())
        count = restored.restore_rows(rows, merge_states(self.states.values()))
        assert count == len(self.echoed.table)
        assert restored.snapshot() == self.echoed.table.snapshot()
        assert restored.pool_usage() == self.echoed.table.pool_usage()


FoldMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=25, deadline=None)
test_fold_machine = FoldMachine.TestCase


@given(st.lists(records(), max_size=30), st.binary(max_size=20))
def test_unreadable_records_change_nothing(
    inputs: list[tuple[str, int, object]], junk: bytes
) -> None:
    fold = TaskFold()
    _feed(fold, inputs, echo=True)
    before = fold.table.snapshot()
    bad = fold.bad_records
    assert fold.task(b"k", b"\xff" + junk, live=True) is not None
    assert fold.task(b"k", b"\xff" + junk, live=False) is None, "said once, when read live"
    assert fold.event(b"\xff" + junk, ref=("resume", 0)) is not None
    assert fold.table.snapshot() == before
    assert fold.bad_records == bad + 3


def test_states_of_different_formats_do_not_merge() -> None:
    state = {"format": 1, "clock": T0.isoformat(), "repair": [], "cancels": []}
    later = {**state, "clock": (T0 + dt.timedelta(hours=1)).isoformat(), "repair": ["k"]}
    assert merge_states([state, later]) == {**later, "repair": ["k"]}
    with pytest.raises(ValueError, match="different formats"):
        merge_states([state, {**state, "format": 2}])


@given(st.lists(st.sampled_from(list(Phase)), max_size=12))
def test_the_lifecycle_moves_only_along_its_edges(moves: list[Phase]) -> None:
    machine = PhaseMachine()
    for to in moves:
        before = machine.phase
        try:
            machine.move(to)
        except IllegalTransition:
            assert machine.phase is before
            assert before is Phase.STOPPED or to is not Phase.STOPPED, "stopping always works"
        else:
            assert machine.phase is to
    if machine.phase is Phase.STOPPED:
        with pytest.raises(IllegalTransition, match="scheduler cannot go from stopped"):
            machine.move(Phase.RUNNING)


@given(st.lists(records(), max_size=30), st.integers(1, 4), st.integers(0, 3))
def test_a_partition_leaves_and_joins_the_table_whole(
    inputs: list[tuple[str, int, object]], partitions: int, moved: int
) -> None:
    """A partition folded on its own and absorbed, or dropped, leaves the table as if it had
    been folded with the others, or never read: same tasks, same slots, same admissions."""
    pools = Pools(slots={"a": 1, "b": 2})
    states = [item for item in inputs if item[0] == "task"]  # events would wait as pending

    def part(i: int) -> int:
        return partition_for(_task(i).ti_key.encode(), partitions)

    def folded(items: list[tuple[str, int, object]]) -> TaskFold:
        fold = TaskFold(pools)
        for _, i, record in items:
            value = encode(record) if isinstance(record, TaskStateRecord) else record
            assert value is None or isinstance(value, bytes)
            fold.task(_task(i).ti_key.encode(), value, live=True)
        return fold

    p = moved % partitions
    whole = folded(states)
    merged = folded([item for item in states if part(item[1]) != p])
    alone = folded([item for item in states if part(item[1]) == p])
    merged.table.absorb(alone.table)
    assert merged.table.snapshot() == whole.table.snapshot()
    assert merged.table.pool_usage() == whole.table.pool_usage()
    assert [encode(e.record) for e in merged.drain()] == [encode(e.record) for e in whole.drain()]

    rest = folded([item for item in states if part(item[1]) != p])
    whole = folded(states)
    whole.table.drop_where(lambda key: partition_for(key.encode(), partitions) == p)
    assert whole.table.snapshot() == rest.table.snapshot()
    assert whole.table.pool_usage() == rest.table.pool_usage()


@given(st.lists(records(), max_size=30), st.integers(1, 4), st.integers(0, 3), st.booleans())
def test_an_absorbed_partition_settles_its_pool_wants_as_if_folded_with_the_others(
    inputs: list[tuple[str, int, object]], partitions: int, moved: int, restored: bool
) -> None:
    """With a pool ledger (pool "a" limited, "b" not), a partition folded on its own, or
    restored from its checkpoint, and absorbed publishes the same wants and decisions at the
    next drain as a table that folded everything."""
    pools = Pools(slots={"a": 1}, default_slots=None)
    ledger = LedgerAdmission(partition_of=lambda key: partition_for(key.encode(), partitions))
    states = [item for item in inputs if item[0] == "task"]
    p = moved % partitions

    def part(i: int) -> int:
        return partition_for(_task(i).ti_key.encode(), partitions)

    def folded(items: list[tuple[str, int, object]]) -> TaskFold:
        fold = TaskFold(pools, ledger=ledger)
        fold.table.track_changes()
        for _, i, record in items:
            value = encode(record) if isinstance(record, TaskStateRecord) else record
            assert value is None or isinstance(value, bytes)
            fold.task(_task(i).ti_key.encode(), value, live=True)
        return fold

    whole = folded(states)
    merged = folded([item for item in states if part(item[1]) != p])
    alone = folded([item for item in states if part(item[1]) == p])
    if restored:
        rows = alone.table.export_changes().encode()
        alone = TaskFold(pools, ledger=ledger)
        alone.table.restore_rows(rows.rows, rows.state)
    merged.table.absorb(alone.table)
    assert len(alone.table) == 0
    assert merged.table.snapshot() == whole.table.snapshot()
    assert merged.table.pool_usage() == whole.table.pool_usage()
    assert [encode(e.record) for e in merged.drain()] == [encode(e.record) for e in whole.drain()]
    assert merged.table.take_pool_writes() == whole.table.take_pool_writes()


def test_absorb_refuses_shared_keys_and_pending_events() -> None:
    first, second = TaskFold(), TaskFold()
    record = TaskStateRecord(task=_task(0), state="running", source="worker", updated_at=T0)
    first.task(b"k", encode(record), live=True)
    second.task(b"k", encode(record), live=True)
    with pytest.raises(ValueError, match="other keys only"):
        first.table.absorb(second.table)
    trigger_id = make_trigger_id(_task(1), 0)
    event = TriggerEventRecord(
        event_id=make_event_id(trigger_id, "fired", None),
        trigger_id=trigger_id,
        task=_task(1),
        status="fired",
    )
    waiting = TaskFold()
    waiting.event(encode(event), ref=("resume", 0))
    with pytest.raises(ValueError, match="without pending events"):
        first.table.absorb(waiting.table)


def test_a_reset_fold_keeps_ledger_admission() -> None:
    ledger = LedgerAdmission(partition_of=lambda _: 1)
    fold = TaskFold(Pools(slots={"p": 1}), ledger=ledger)
    fold.reset()
    assert fold.table.ledger is ledger
    assert fold.table.pools == Pools(slots={"p": 1})
    assert TaskFold().table.ledger is None
