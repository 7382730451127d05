"""A task table admitting limited pools through the pool ledger: wants out, grants in."""

from __future__ import annotations

import pytest
from deferline.engine import LedgerAdmission, PoolEntry, Pools, TaskTable
from deferline.schemas import PoolGrant, PoolWant, RunTask, TaskStateRecord, make_trigger_id

from .test_taskstate import (
    at,
    deferred,
    echo,
    event,
    feed,
    key,
    runs,
    scheduled,
    states,
    target,
    worker,
)

POOLS = Pools(slots={"p": 2}, default_slots=None)


def table() -> TaskTable:
    return TaskTable(pools=POOLS, ledger=LedgerAdmission(partition_of=lambda _: 4))


def wants(entries: list[PoolEntry]) -> list[tuple[str, PoolWant | None]]:
    assert all(e.kind == "want" for e in entries), "a table writes wants only"
    return [(e.ti_key, e.value) for e in entries]  # type: ignore[misc]


def grant(ti_key: str, try_number: int = 1, pool: str = "p", slots: int = 1) -> PoolEntry:
    value = PoolGrant(pool=pool, slots=slots, try_number=try_number, partition=4)
    return PoolEntry("grant", ti_key, value)


def read_back(t: TaskTable, entries: list[PoolEntry]) -> None:
    for entry in entries:
        t.apply_pool(entry)


def test_a_limited_pool_publishes_a_want_and_starts_on_its_grant() -> None:
    t, task = table(), key(1)
    record = scheduled(task, 3, resume=target(pool="p", priority_weight=7))
    out = feed(t, record)
    assert out == [], "no local admission for a limited pool"
    [(ti_key, value)] = wants(t.take_pool_writes())
    assert ti_key == task.ti_key
    assert value == PoolWant(
        pool="p", slots=1, priority_weight=7, scheduled_at=at(3), try_number=1, partition=4
    )
    t.apply_pool(PoolEntry("want", ti_key, value))  # read back: nothing to do
    assert t.drain() == []
    assert t.take_pool_writes() == []
    t.apply_pool(grant(ti_key))
    out = t.drain()
    assert [(type(e.record).__name__, e.key) for e in out] == [
        ("TaskStateRecord", ti_key),
        ("RunTask", ti_key),
    ]
    assert [s.state for s in states(out)] == ["queued"]
    assert t.counters.starts == 1
    assert t.take_pool_writes() == [], "the want stays while the task holds its slot"
    assert t.pool_usage()["p"] == (1, 2)


def test_unlimited_pools_start_at_once_without_the_ledger() -> None:
    t = table()
    out = feed(t, scheduled(key(1), resume=target(pool="free")))
    assert [r.mode for r in runs(out)] == ["start"]
    assert t.take_pool_writes() == []


def test_the_want_is_tombstoned_when_the_task_ends_and_again_never() -> None:
    t, task = table(), key(1)
    feed(t, scheduled(task, resume=target(pool="p")))
    written = t.take_pool_writes()
    read_back(t, written)
    t.apply_pool(grant(task.ti_key))
    echo(t, t.drain())
    feed(t, worker(task, "running", 1))
    assert t.take_pool_writes() == []
    feed(t, worker(task, "success", 2))
    gone = t.take_pool_writes()
    assert wants(gone) == [(task.ti_key, None)]
    read_back(t, gone)
    t.apply_pool(grant(task.ti_key))  # the grant is still live until the ledger frees it
    assert t.drain() == []
    assert t.take_pool_writes() == []


def test_a_retry_wants_slots_for_its_new_try() -> None:
    t, task = table(), key(1)
    feed(t, scheduled(task, resume=target(pool="p")))
    read_back(t, t.take_pool_writes())
    t.apply_pool(grant(task.ti_key))
    echo(t, t.drain())
    feed(t, worker(task, "running", 1))
    out = feed(t, worker(task, "up_for_retry", 2))
    assert [(s.state, s.task.try_number) for s in states(out)] == [("scheduled", 2)]
    [(_, value)] = wants(t.take_pool_writes())
    assert value is not None
    assert value.try_number == 2
    t.apply_pool(grant(task.ti_key, try_number=1))  # the old try's grant: not for this try
    assert runs(t.drain()) == []
    t.apply_pool(grant(task.ti_key, try_number=2))
    assert [(r.mode, r.task.try_number) for r in runs(t.drain())] == [("start", 2)]


def test_a_grant_for_a_task_that_moved_on_is_released() -> None:
    t, task = table(), key(1)
    feed(t, scheduled(task, resume=target(pool="p")))
    read_back(t, t.take_pool_writes())
    feed(t, TaskStateRecord(task=task, state="removed", source="client", updated_at=at(1)))
    released = t.take_pool_writes()
    assert wants(released) == [(task.ti_key, None)]
    read_back(t, released)
    t.apply_pool(grant(task.ti_key))
    assert t.drain() == [], "a removed task is not started by a late grant"
    assert t.take_pool_writes() == []


def test_a_resume_keeps_the_slot_and_never_asks_the_ledger() -> None:
    t, task = table(), key(1)
    feed(t, scheduled(task, resume=target(pool="p")))
    read_back(t, t.take_pool_writes())
    t.apply_pool(grant(task.ti_key))
    echo(t, t.drain())
    feed(t, worker(task, "running", 1), deferred(task, 0, 2))
    t.apply(event(task, when=3))
    out = t.drain()
    assert [r.mode for r in runs(out)] == ["resume"], "no round trip for a resume"
    assert t.take_pool_writes() == []
    feed(t, worker(task, "running", 4, trigger_id=make_trigger_id(task, 0)))
    assert t.take_pool_writes() == []


def test_a_task_holding_a_slot_without_a_want_gets_one() -> None:
    """A task found queued (admitted before the ledger) is published so the ledger counts it."""
    t, task = table(), key(1)
    t.apply(scheduled(task, resume=target(pool="p")))
    t.apply(TaskStateRecord(task=task, state="queued", updated_at=at(1), resume=target(pool="p")))
    assert t.drain() == []
    [(_, value)] = wants(t.take_pool_writes())
    assert value is not None
    assert (value.try_number, value.held) == (1, True), "counted by the ledger at once"


def test_a_rebuilt_table_does_not_start_a_started_task_again() -> None:
    first, task = table(), key(1)
    feed(first, scheduled(task, resume=target(pool="p")))
    pools_topic = first.take_pool_writes()
    pools_topic.append(grant(task.ti_key))
    read_back(first, pools_topic)
    tasks_topic = [scheduled(task, resume=target(pool="p")), *states(first.drain())]
    again = table()
    for record in tasks_topic:
        again.apply(record)
    read_back(again, pools_topic)
    assert again.drain() == []
    assert again.take_pool_writes() == []


def test_a_checkpoint_restores_and_the_pools_topic_settles_the_rest() -> None:
    original, waiting, started = table(), key(1), key(2)
    original.track_changes()
    for task in (waiting, started):
        original.apply(scheduled(task, resume=target(pool="p")))
    original.drain()
    pools_topic = original.take_pool_writes()
    pools_topic.append(grant(started.ti_key))
    read_back(original, pools_topic)
    echo(original, original.drain())
    rows = original.export_changes().encode()
    restored = table()
    restored.restore_rows(rows.rows, rows.state)
    read_back(restored, pools_topic)
    assert restored.drain() == [], "neither task is started again"
    assert restored.take_pool_writes() == []
    restored.apply_pool(grant(waiting.ti_key))
    assert [r.task.task_id for r in runs(restored.drain())] == ["t1"]


def test_a_table_without_a_ledger_refuses_pool_records() -> None:
    with pytest.raises(ValueError, match="admits locally"):
        TaskTable().apply_pool(grant("x"))
    assert TaskTable().take_pool_writes() == []


def test_the_run_task_is_the_one_local_admission_sends() -> None:
    local = TaskTable(pools=POOLS)
    ledger = table()
    record = scheduled(key(1), resume=target(pool="p", priority_weight=3))
    by_local = runs(feed(local, record))
    feed(ledger, record)
    ledger.apply_pool(grant(key(1).ti_key))
    by_ledger = runs(ledger.drain())
    assert by_ledger == by_local
    assert all(isinstance(r, RunTask) for r in by_ledger)


def test_an_absorbed_partition_publishes_its_wants_and_a_dropped_one_forgets_them() -> None:
    """A partition folded on its own (no drain) and joined to the table wants its slots at
    the next drain; dropped, its wants and grants are forgotten, so when it comes back the
    ones read again from the pools topic decide."""
    t, side, task = table(), table(), key(1)
    side.apply(scheduled(task, 3, resume=target(pool="p")))
    t.absorb(side)
    assert t.drain() == []
    [(ti_key, want)] = wants(t.take_pool_writes())
    assert ti_key == task.ti_key
    assert want is not None
    t.apply_pool(PoolEntry("want", ti_key, want))
    t.apply_pool(grant(ti_key))
    claims = t.pool_claims
    assert claims is not None
    assert claims.grant(ti_key) is not None
    t.drop_where(lambda k: k == ti_key)
    assert len(t) == 0
    assert claims.want(ti_key) is None
    assert claims.grant(ti_key) is None
    assert claims.wanting() == 0
    # Back again, with the pools records read again: the grant starts it, no new want.
    again = table()
    again.apply(scheduled(task, 3, resume=target(pool="p")))
    t.absorb(again)
    t.apply_pool(PoolEntry("want", ti_key, want))
    t.apply_pool(grant(ti_key))
    assert [s.state for s in states(t.drain())] == ["queued"]
    assert t.take_pool_writes() == []


@pytest.mark.parametrize("restored", [False, True])
def test_an_absorbed_partition_settles_only_tasks_of_limited_pools(restored: bool) -> None:
    """A restart absorbs every task: those of unlimited pools have nothing to settle unless
    a want is read for them, which marks them itself."""
    t, side = table(), table()
    side.track_changes()
    side.apply(deferred(key(1), resume=target(pool="unlimited")))
    side.apply(scheduled(key(2), 1, resume=target(pool="p")))
    if restored:
        rows = side.export_changes().encode()
        side = table()
        side.restore_rows(rows.rows, rows.state)
    t.absorb(side)
    claims = t.pool_claims
    assert claims is not None
    assert claims.dirty == {key(2).ti_key}
    assert t.drain() == []
    assert [ti_key for ti_key, _ in wants(t.take_pool_writes())] == [key(2).ti_key]
    stray = PoolWant(pool="unlimited", slots=1, scheduled_at=at(1), try_number=1, partition=4)
    t.apply_pool(PoolEntry("want", key(1).ti_key, stray))
    assert claims.dirty == {key(1).ti_key}
    t.drain()
    assert wants(t.take_pool_writes()) == [(key(1).ti_key, None)], "tombstoned"


def test_a_table_admitting_locally_absorbed_settles_its_tasks_of_limited_pools() -> None:
    t, side = table(), TaskTable(pools=POOLS)
    side.apply(deferred(key(1), resume=target(pool="unlimited")))
    side.apply(scheduled(key(2), 1, resume=target(pool="p")))
    t.absorb(side)
    claims = t.pool_claims
    assert claims is not None
    assert claims.dirty == {key(2).ti_key}
