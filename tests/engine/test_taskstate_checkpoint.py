"""Checkpoints of the task table: a restored table decides exactly as the table it was
taken from (standby-like) and as a full fold of the topics (after a restart)."""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

import orjson
import pytest
from deferline.engine import Emit, Pools, TaskTable
from deferline.engine.testing import FORMAT, Stored
from deferline.schemas import ResumeTarget, TaskStateRecord, TriggerEventRecord, encode
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.test_taskstate import (
    _KINDS,
    _World,
    deferred,
    deferred_task,
    key,
    scheduled,
    target,
    worker,
)


class _Store:
    """What the scheduler's rocksdict store does with exports: upsert, delete, overwrite."""

    def __init__(self) -> None:
        self.rows: dict[bytes, bytes] = {}
        self.state: dict[str, Any] = {}

    def save(self, table: TaskTable) -> None:
        encoded = table.export_changes().encode()
        for k in encoded.deletes:
            self.rows.pop(k, None)
        self.rows.update(encoded.rows)
        # Through JSON, as stored.
        self.state = orjson.loads(orjson.dumps(encoded.state))

    def restore(self, pools: Pools) -> TaskTable:
        table = TaskTable(pools=pools)
        assert table.restore_rows(sorted(self.rows.items()), self.state) == len(self.rows)
        return table


def _wire(out: list[Emit]) -> list[bytes]:
    return [encode(e.record) for e in out]


def _same(a: TaskTable, b: TaskTable) -> None:
    assert a.snapshot() == b.snapshot()
    assert a.pool_usage() == b.pool_usage()
    assert a.clock == b.clock
    assert a.count_by_state() == b.count_by_state()
    moments = [a.clock + dt.timedelta(seconds=s) for s in (-5, 0, 5, 3600)]
    assert [a.overdue_deferrals(m) for m in moments] == [b.overdue_deferrals(m) for m in moments]


def _world(seed: int, scripts: list[list[str]], dups: int, slots: int) -> _World:
    world = _World(
        rng=random.Random(seed),
        scripts={key(n).ti_key: script for n, script in enumerate(scripts)},
        dups=dups,
        pools=Pools(slots={"default_pool": slots}),
    )
    world.run()
    return world


@settings(max_examples=40, deadline=None)
@given(
    scripts=st.lists(st.lists(_KINDS, max_size=3), min_size=1, max_size=6),
    dups=st.integers(0, 1),
    slots=st.integers(1, 3),
    seed=st.integers(0, 2**32),
    cuts=st.lists(st.floats(0, 1), min_size=1, max_size=3),
)
def test_a_restored_standby_table_decides_as_the_original(
    scripts: list[list[str]], dups: int, slots: int, seed: int, cuts: list[float]
) -> None:
    """Fold the tasks topic without deciding (a standby), checkpoint at a few points, restore,
    then feed the rest of the tasks topic and every event to both: same output, byte for
    byte, and the same state."""
    world = _world(seed, scripts, dups, slots)
    log = world.tasks_log
    stops = sorted({int(c * len(log)) for c in cuts})
    original, store, read = TaskTable(pools=world.pools), _Store(), 0
    original.track_changes()
    for stop in stops:
        for record in log[read:stop]:
            original.apply(record)
        read = stop
        store.save(original)
    _same(original, store.restore(world.pools))
    restored = store.restore(world.pools)  # undecoded rows decide too, read as they are needed
    rng = random.Random(seed)
    rest: list[TaskStateRecord | TriggerEventRecord] = [*log[read:], *world.events_log]
    rng.shuffle(rest)  # any order: both see the same one
    for item in rest:
        assert original.apply(item) == restored.apply(item)
        assert _wire(original.drain()) == _wire(restored.drain())
    _same(original, restored)


@settings(max_examples=40, deadline=None)
@given(
    scripts=st.lists(st.lists(_KINDS, min_size=1, max_size=3), min_size=1, max_size=6),
    dups=st.integers(0, 1),
    slots=st.integers(1, 3),
    seed=st.integers(0, 2**32),
    cut=st.floats(0.1, 0.9),
)
def test_a_restart_from_a_checkpoint_decides_as_a_full_fold(
    scripts: list[list[str]], dups: int, slots: int, seed: int, cut: float
) -> None:
    """An active table checkpointed midway (its own writes published, not all read back)
    then "restarted": restored and fed the tasks topic's tail ends in the state a full fold
    of the whole topic reaches, and both decide the same from there on, events included."""
    world = _World(
        rng=random.Random(seed),
        scripts={key(n).ti_key: script for n, script in enumerate(scripts)},
        dups=dups,
        pools=Pools(slots={"default_pool": slots}),
    )
    world.table.track_changes()
    store, saved_at = _Store(), 0
    # world.run, checkpointing once the tasks topic is about ``cut`` of its final length.
    for n in range(len(scripts)):
        world.tasks_log.append(scheduled(key(n), 0, resume=target(retries=1)))
    steps = 0
    while acts := world.actions():
        act = world.rng.choice(acts)
        if act == "read_task":
            world.table.apply(world.tasks_log[world.t_read])
            world.t_read += 1
        elif act == "read_event":
            world.table.apply(world.events_log[world.e_read])
            world.e_read += 1
        elif act == "work":
            world.work()
        else:
            world.fire()
        if act.startswith("read"):
            world.publish(world.table.drain())
        steps += 1
        if steps == int(cut * 40):
            store.save(world.table)
            saved_at = world.t_read
    if not store.state:
        store.save(world.table)
        saved_at = world.t_read
    restored = store.restore(world.pools)
    full = TaskTable(pools=world.pools)
    for record in world.tasks_log[saved_at:]:
        restored.apply(record)
    for record in world.tasks_log:
        full.apply(record)
    assert restored.snapshot() == full.snapshot()
    assert restored.pool_usage() == full.pool_usage()
    assert _shape(restored.drain()) == _shape(full.drain())
    for event in world.events_log:  # resume offsets are committed no further than applied
        restored.apply(event)
        full.apply(event)
        assert _shape(restored.drain()) == _shape(full.drain())
    assert restored.snapshot() == full.snapshot()


def _shape(out: list[Emit]) -> list[bytes]:
    """Output without times: a restored table's clock also counts events it read before the
    checkpoint (a bare fold of the tasks topic has no such times), and admissions use it."""
    dropped = {"updated_at", "enqueued_at", "requested_at"}
    return [
        orjson.dumps(e.record.model_dump(mode="json", exclude=dropped), option=orjson.OPT_SORT_KEYS)
        for e in out
    ]


def test_only_changed_and_forgotten_tasks_are_exported() -> None:
    table = TaskTable(pools=Pools(slots={"default_pool": 4}))
    for n in range(3):
        table.apply(scheduled(key(n), n))
    table.track_changes()
    first = table.export_changes()
    assert sorted(k for k, *_ in first.upserts) == sorted(key(n).ti_key for n in range(3))
    assert table.export_changes().upserts == []
    table.apply(worker(key(1), "running", 5))
    table.forget(key(2).ti_key)
    delta = table.export_changes()
    assert [k for k, *_ in delta.upserts] == [key(1).ti_key]
    assert delta.deletes == [key(2).ti_key]


def test_restore_keeps_values_targets_and_pending_decisions() -> None:
    table = TaskTable(pools=Pools(slots={"default_pool": 1}))
    table.track_changes()
    deferred_task(table, key(1), next_kwargs={"when": key(1).model_dump(), "n": (1, 2)})
    table.apply(scheduled(key(2), 2, resume=target(priority_weight=5)))  # waits: pool full
    table.apply(scheduled(key(3), 3, resume=ResumeTarget(operator="pkg.Op", pool="other")))
    table.apply(worker(key(3), "running", 4))
    table.apply(scheduled(key(3), 1))  # stale: repaired at the next drain
    table.apply(
        TaskStateRecord(
            task=key(1), state="removed", source="client", updated_at=deferred(key(1)).updated_at
        )
    )
    table.apply(scheduled(key(4), 4, resume=ResumeTarget(operator="pkg.Op", pool="other")))
    table.apply(worker(key(4), "up_for_retry", 5))  # retried at the next drain
    store = _Store()
    store.save(table)
    restored = store.restore(table.pools)
    _same(table, restored)
    assert _wire(table.drain()) == _wire(restored.drain())


def test_a_checkpoint_of_another_format_is_refused() -> None:
    table = TaskTable()
    table.track_changes()
    table.apply(scheduled(key(1)))
    store = _Store()
    store.save(table)
    store.state["format"] = 99
    with pytest.raises(ValueError, match="format"):
        store.restore(table.pools)
    with pytest.raises(ValueError, match="decode"):
        TaskTable().restore_rows([(b"k", b"[1,2]")], {**store.state, "format": FORMAT})


def test_a_restore_decodes_a_deferred_or_finished_task_only_when_it_is_read() -> None:
    table = TaskTable(pools=Pools(slots={"default_pool": 4}))
    table.track_changes()
    timeout = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    deferred_task(table, key(1), next_kwargs={"when": key(1).model_dump()}, timeout_at=timeout)
    table.apply(scheduled(key(2), 2))
    table.apply(worker(key(2), "success", 3))
    store = _Store()
    store.save(table)
    restored = store.restore(table.pools)
    rows: dict[str, Any] = {k: restored._views[k].record for k in (key(1).ti_key, key(2).ti_key)}
    assert all(type(r) is Stored and r.raw is not None for r in rows.values())
    # What the indexes and the metrics read comes from the head alone.
    assert restored.count_by_state() == table.count_by_state()
    assert restored.overdue_deferrals(timeout) == 0
    assert restored.overdue_deferrals(timeout + dt.timedelta(seconds=1)) == 1
    assert restored.pool_usage() == table.pool_usage()
    assert restored.forget_finished(1e9) == 0
    assert all(r.raw is not None for r in rows.values())
    # Unread rows are exported as they were read; a read decodes the whole record.
    restored.track_changes()
    restored.mark_changed(rows)
    assert dict(restored.export_changes().encode().rows) == {
        k.encode(): store.rows[k.encode()] for k in rows
    }
    assert restored.get(key(1).ti_key) == table.get(key(1).ti_key)
    assert rows[key(1).ti_key].raw is None
    assert rows[key(2).ti_key].raw is not None
    _same(table, restored)


def test_a_restore_shares_a_target_between_tasks_only_without_op_kwargs() -> None:
    """Rows whose targets alternate (plain, with op_kwargs, none) restore each task's own
    target: a plain target is one object for all its tasks, one with op_kwargs (a dict a
    task may be given) is each task's own."""
    plain = ResumeTarget(operator="pkg.Op")
    other = ResumeTarget(operator="pkg.Other", pool="p")
    table = TaskTable()
    table.track_changes()
    resumes = [plain, plain, target(), target(), None, plain, other, other, target(), plain]
    for n, resume in enumerate(resumes):
        deferred_task(table, key(n), resume=resume)
    store = _Store()
    store.save(table)
    restored = store.restore(table.pools)
    _same(table, restored)
    views = restored._views
    got = [views[key(n).ti_key].target for n in range(len(resumes))]
    assert got == resumes
    assert got[0] is got[1] is got[5] is got[9]
    assert got[6] is got[7]
    kwargs_targets = [got[n] for n in (2, 3, 8)]
    assert len({id(t) for t in kwargs_targets}) == 3
