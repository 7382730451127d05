"""The whole pool loop in memory: partition tables publish wants, one ledger grants, the
tables start granted tasks; a fake pools topic delivers late and again, tables and the ledger
owner restart from the topics. Checked at every step: no pool ever has more tasks holding
slots than its size, and no attempt is started twice; at the end every task has run."""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferline.engine import (
    HOLDING_STATES,
    LedgerAdmission,
    PoolEntry,
    PoolLedger,
    Pools,
    TaskTable,
)
from deferline.schemas import (
    ResumeTarget,
    RunTask,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    make_event_id,
    make_trigger_id,
)
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
PARTITIONS = 3
SIZES = {"p": 2, "q": 3}
TASKS = 8


def partition_of(ti_key: str) -> int:
    return int(ti_key.split("/")[1][1:]) % PARTITIONS


def task_key(n: int, try_number: int = 1) -> TaskKey:
    return TaskKey(dag_id="dag", task_id=f"t{n}", run_id="r1", try_number=try_number)


def new_table() -> TaskTable:
    return TaskTable(
        pools=Pools(slots=SIZES, default_slots=None),
        ledger=LedgerAdmission(partition_of=partition_of),
    )


def routed(entry: PoolEntry) -> int | None:
    """The partition whose owner reads a pools record (the ledger reads them all)."""
    return partition_of(entry.ti_key)


Input = TaskStateRecord | TriggerEventRecord


class PoolLoop(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pools_topic: list[PoolEntry] = []
        self.tables = [new_table() for _ in range(PARTITIONS)]
        self.table_cursor = [0] * PARTITIONS
        self.tasks_log: list[list[Input]] = [[] for _ in range(PARTITIONS)]
        self.ledger = PoolLedger(Pools(slots=SIZES, default_slots=None))
        self.ledger_cursor = 0
        self.unsent: list[PoolEntry] = []
        self.targets: dict[int, ResumeTarget] = {}
        self.submitted: set[int] = set()
        self.starts: set[tuple[str, int]] = set()
        self.clock = 0

    @initialize(
        shapes=st.lists(
            st.tuples(st.sampled_from(["p", "q", "free"]), st.integers(1, 2), st.integers(0, 3)),
            min_size=TASKS,
            max_size=TASKS,
        )
    )
    def shape_tasks(self, shapes: list[tuple[str, int, int]]) -> None:
        for n, (pool, slots, weight) in enumerate(shapes):
            self.targets[n] = ResumeTarget(
                operator="pkg.mod.Op", pool=pool, pool_slots=slots, priority_weight=weight
            )
            self.submit(n)

    # -- helpers ------------------------------------------------------------------------------

    def now(self) -> dt.datetime:
        self.clock += 1
        return T0 + dt.timedelta(seconds=self.clock)

    def table_of(self, n: int) -> tuple[int, TaskTable]:
        part = partition_of(task_key(n).ti_key)
        return part, self.tables[part]

    def feed(self, n: int, record: Input) -> None:
        part, table = self.table_of(n)
        self.tasks_log[part].append(record)
        table.apply(record)

    def state(self, n: int) -> TaskStateRecord | None:
        return self.table_of(n)[1].get(task_key(n).ti_key)

    # -- clients and workers ------------------------------------------------------------------

    def submit(self, n: int) -> None:
        if n not in self.submitted:
            self.submitted.add(n)
            record = TaskStateRecord(
                task=task_key(n),
                state="scheduled",
                source="client",
                updated_at=self.now(),
                resume=self.targets[n],
            )
            self.feed(n, record)

    @rule(n=st.integers(0, TASKS - 1), outcome=st.sampled_from(["success", "retry", "defer"]))
    def worker_step(self, n: int, outcome: str) -> None:
        record = self.state(n)
        if record is None:
            return
        task = record.task
        if record.state == "queued":
            fields: dict[str, Any] = {}
            if record.trigger_id is not None:  # running again after a resume
                fields = {"trigger_id": record.trigger_id, "defer_seq": record.defer_seq}
            self.feed(n, self.worker(task, "running", **fields))
        elif record.state == "running":
            if outcome == "defer" and record.trigger_id is None:
                self.feed(
                    n,
                    self.worker(
                        task,
                        "deferred",
                        trigger_id=make_trigger_id(task, 0),
                        next_method="execute_complete",
                    ),
                )
            elif outcome == "retry" and task.try_number < 3:
                self.feed(n, self.worker(task, "up_for_retry"))
            else:
                self.feed(n, self.worker(task, "success"))

    @rule(n=st.integers(0, TASKS - 1))
    def trigger_fires(self, n: int) -> None:
        record = self.state(n)
        if record is not None and record.state == "deferred":
            trigger_id = make_trigger_id(record.task, 0)
            event = TriggerEventRecord(
                event_id=make_event_id(trigger_id, "fired", None),
                trigger_id=trigger_id,
                task=record.task,
                status="fired",
                emitted_at=self.now(),
            )
            self.feed(n, event)

    def worker(self, task: TaskKey, state: Any, **fields: Any) -> TaskStateRecord:
        return TaskStateRecord(
            task=task, state=state, source="worker", updated_at=self.now(), **fields
        )

    # -- partition owners ---------------------------------------------------------------------

    @rule(part=st.integers(0, PARTITIONS - 1))
    def table_drains(self, part: int) -> None:
        """One transaction: the drain's task states (read back at once) and its wants."""
        table = self.tables[part]
        out = table.drain()
        for emit in out:
            record = emit.record
            if isinstance(record, TaskStateRecord):
                self.tasks_log[part].append(record)
                table.apply(emit.written)
            elif isinstance(record, RunTask) and record.mode == "start":
                attempt = (record.task.ti_key, record.task.try_number)
                assert attempt not in self.starts, f"{attempt} started twice"
                self.starts.add(attempt)
        self.pools_topic += table.take_pool_writes()

    @rule(part=st.integers(0, PARTITIONS - 1), n=st.integers(1, 8))
    def table_reads(self, part: int, n: int) -> None:
        table = self.tables[part]
        end = min(self.table_cursor[part] + n, len(self.pools_topic))
        for entry in self.pools_topic[self.table_cursor[part] : end]:
            if routed(entry) == part:
                table.apply_pool(entry)
        self.table_cursor[part] = end

    @rule(part=st.integers(0, PARTITIONS - 1), data=st.data())
    def table_reads_again(self, part: int, data: st.DataObject) -> None:
        """A re-delivery: the consumer goes back to an earlier offset and reads on."""
        if self.table_cursor[part]:
            self.table_cursor[part] = data.draw(st.integers(0, self.table_cursor[part] - 1))

    @rule(part=st.integers(0, PARTITIONS - 1))
    def table_restarts(self, part: int) -> None:
        """A new owner: the tasks partition and the pools topic read to their ends first."""
        table = new_table()
        for record in self.tasks_log[part]:
            table.apply(record)
        for entry in self.pools_topic:
            if routed(entry) == part:
                table.apply_pool(entry)
        self.tables[part] = table
        self.table_cursor[part] = len(self.pools_topic)

    # -- the ledger owner ---------------------------------------------------------------------

    @rule(n=st.integers(1, 10))
    def ledger_reads(self, n: int) -> None:
        end = min(self.ledger_cursor + n, len(self.pools_topic))
        for offset in range(self.ledger_cursor, end):
            self.ledger.apply(self.pools_topic[offset], offset=offset)
        self.ledger_cursor = end

    @rule(data=st.data())
    def ledger_reads_again(self, data: st.DataObject) -> None:
        if self.ledger_cursor:
            self.ledger_cursor = data.draw(st.integers(0, self.ledger_cursor - 1))

    @rule()
    def ledger_decides(self) -> None:
        self.unsent += self.ledger.decide()

    @rule()
    def ledger_writes(self) -> None:
        self.pools_topic += self.unsent
        self.unsent = []

    @rule()
    def ledger_owner_changes(self) -> None:
        self.unsent = []  # its open transaction is aborted
        latest: dict[str, tuple[int, PoolEntry]] = {}
        for offset, entry in enumerate(self.pools_topic):
            latest[entry.key] = (offset, entry)
        self.ledger = PoolLedger(Pools(slots=SIZES, default_slots=None))
        for offset, entry in sorted(latest.values(), key=lambda pair: pair[0]):
            self.ledger.apply(entry, offset=offset)
        self.ledger_cursor = len(self.pools_topic)
        self.unsent += self.ledger.decide()

    # -- whole rounds (so that random runs get far) ------------------------------------------

    @rule(order=st.permutations(range(PARTITIONS)))
    def pool_round(self, order: list[int]) -> None:
        """Every owner drains, the ledger reads, decides and writes, every owner reads."""
        for part in order:
            self.table_drains(part)
        self.ledger_reads(len(self.pools_topic))
        self.ledger_decides()
        self.ledger_writes()
        for part in order:
            self.table_reads(part, len(self.pools_topic))
            self.table_drains(part)

    @rule(outcomes=st.lists(st.sampled_from(["success", "retry", "defer"]), min_size=TASKS))
    def worker_round(self, outcomes: list[str]) -> None:
        for n in range(TASKS):
            self.trigger_fires(n)
            self.worker_step(n, outcomes[n])

    # -- checks -------------------------------------------------------------------------------

    @invariant()
    def holders_never_exceed_a_pool(self) -> None:
        held: dict[str, int] = {}
        for n in self.submitted:
            record = self.state(n)
            if record is not None and record.state in HOLDING_STATES:
                target = self.targets[n]
                held[target.pool] = held.get(target.pool, 0) + target.pool_slots
        for pool, size in SIZES.items():
            assert held.get(pool, 0) <= size, f"pool {pool}: {held[pool]} slots held of {size}"

    @invariant()
    def holders_have_their_grant_in_the_ledger(self) -> None:
        """Once the ledger has read the whole topic, it counts every holder's slots."""
        if self.ledger_cursor < len(self.pools_topic) or self.unsent or not self.ledger.deciding:
            return
        for n in self.submitted:
            record = self.state(n)
            target = self.targets[n]
            if record is None or record.state not in HOLDING_STATES or target.pool not in SIZES:
                continue
            grant = self.ledger.grant(record.task.ti_key)
            assert grant is not None, f"{record.task} holds a slot the ledger does not count"
            assert (grant.try_number, grant.pool, grant.slots) == (
                record.task.try_number,
                target.pool,
                target.pool_slots,
            ), f"{record.task} holds a slot granted to {grant}"

    def teardown(self) -> None:
        if not self.targets:
            return
        for _ in range(12 * TASKS):
            for part in range(PARTITIONS):
                self.table_drains(part)
            self.ledger_reads(len(self.pools_topic))
            self.ledger_decides()
            self.ledger_writes()
            for part in range(PARTITIONS):
                self.table_reads(part, len(self.pools_topic))
                self.table_drains(part)
            for n in range(TASKS):
                self.trigger_fires(n)
                self.worker_step(n, "success")
            self.holders_never_exceed_a_pool()
        unfinished = {n: self.state(n) for n in range(TASKS)}
        assert all(r is not None and r.state == "success" for r in unfinished.values()), {
            n: r.state if r else None for n, r in unfinished.items()
        }
        # Every want was tombstoned and every grant freed: no slot leaks.
        self.pool_round(list(range(PARTITIONS)))
        live: dict[str, PoolEntry] = {}
        for entry in self.pools_topic:
            if entry.value is None:
                live.pop(entry.key, None)
            else:
                live[entry.key] = entry
        assert live == {}, sorted(live)
        assert self.ledger.live_grants() == {}


PoolLoop.TestCase.settings = settings(max_examples=100, stateful_step_count=80, deadline=None)
TestPoolLoop = PoolLoop.TestCase
