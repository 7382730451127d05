"""The scheduler runner without a broker: routing, publish order, commits, bad input, CLI."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError
from click.testing import CliRunner
from deferline.engine import Emit, PoolLedger, Pools
from deferline.runners.member import MemberFenced
from deferline.runners.scheduler import (
    PoolChannel,
    Scheduler,
    SchedulerError,
    scheduler_command,
)

# The modules whose names the tests patch (no door can stand for those).
from deferline.runners.scheduler.testing import BATCHES_AHEAD, Phase, parse_pools
from deferline.runners.testing import FencedByGroup, GroupMetadata
from deferline.schemas import (
    CancelRequest,
    DeadLetter,
    ResumeTarget,
    RunTask,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    decode,
    encode,
    make_event_id,
    make_trigger_id,
)
from deferline.topics import Settings, partition_for
from prometheus_client import generate_latest

from tests._until import until
from tests.fakes import (
    FakeConsumer,
    FakeKafka,
    FakeProducer,
    FakeTransactionalProducer,
    JournalEntry,
)

TASK = TaskKey(dag_id="d", task_id="t", run_id="r")
TPS = TopicPartition("p.tasks.events", 0)


def producer_of(kafka: FakeKafka | None = None, **options: Any) -> FakeProducer:
    """A partition producer as the publisher makes it (batches of up to 1 MiB), over ``kafka``
    (by default, a broker of one-partition topics)."""
    return FakeProducer(kafka or FakeKafka(), max_batch_size=1 << 20, **options)


class ChainWrites:
    """What one partition's chain hands to the member's producer, as journal entries."""

    def __init__(self, scheduler: Scheduler, partition: int) -> None:
        self.producer = scheduler.producer
        self.entries: list[JournalEntry] = []
        scheduler.writers[partition].chain.producer = self  # type: ignore[assignment]

    @property
    def transactional(self) -> bool | None:
        return self.producer.transactional

    async def write(self, waves: Any, offsets: Any) -> None:
        self.entries += [("send", topic, key) for wave in waves for topic, key, _ in wave]
        await self.producer.write(waves, offsets)


def chain_writes(scheduler: Scheduler, partition: int) -> list[JournalEntry]:
    """The records ``partition``'s chain writes from now on (a live list)."""
    return ChainWrites(scheduler, partition).entries


def journal(scheduler: Scheduler) -> list[JournalEntry]:
    """What the member's producer did (sends, acks, transactions)."""
    (producer,) = scheduler.producer._producers
    assert isinstance(producer, FakeProducer)
    return producer.journal


@pytest.fixture
def sched(monkeypatch: pytest.MonkeyPatch) -> Scheduler:
    ensured: list[Any] = []

    async def fake_ensure(settings: Settings, specs: Any) -> None:
        ensured.append([spec.name for spec in specs])

    monkeypatch.setattr("deferline.runners.scheduler._scheduler.ensure_topics", fake_ensure)
    monkeypatch.setattr("deferline.runners.scheduler._publishing.ensure_topics", fake_ensure)
    scheduler = Scheduler(Settings(topic_prefix="p."), pools=Pools(slots={"default_pool": 1}))
    own_partition_zero(scheduler)
    scheduler.producer._producers = [producer_of()]
    scheduler.producer.transactional = False
    scheduler.ensured = ensured  # type: ignore[attr-defined]
    return scheduler


def own_partition_zero(scheduler: Scheduler) -> None:
    """Make ``scheduler`` the owner of partition 0 of a one-partition layout, as an
    acquisition leaves it (without a broker; its pools channel never reads)."""
    scheduler.router.partitions = 1
    scheduler.clients.pool_channel = PoolChannel(
        scheduler.settings,
        pools=scheduler.table.pools,
        partitions=1,
        consumer=object(),  # never started: nothing is read
    )
    scheduler.writers.add(0)
    scheduler.ownership.assign({0})
    scheduler.ownership.acquired(0)
    scheduler.clients.pool_channel.own(0, scheduler.table)


def admitted(scheduler: Scheduler) -> list[Emit]:
    """Drain the table, then grant the wants it published as the pool ledger would, and
    drain again: the decisions a scheduler takes once its wants are granted."""
    out = scheduler.table.drain()
    channel = scheduler.pool_channel
    assert channel is not None
    ledger = PoolLedger(scheduler.table.pools)
    for entry in scheduler.table.take_pool_writes():
        ledger.apply(entry)
        scheduler.table.apply_pool(entry)  # read back
    for entry in ledger.decide():
        scheduler.table.apply_pool(entry)
    return out + scheduler.table.drain()


def state(record_state: Any = "scheduled", **fields: Any) -> TaskStateRecord:
    fields.setdefault("resume", ResumeTarget(operator="x.Op", worker_queue="gpu"))
    fields.setdefault("source", "client")
    return TaskStateRecord(task=TASK, state=record_state, **fields)


def fired(**fields: Any) -> TriggerEventRecord:
    trigger_id = make_trigger_id(TASK, 0)
    return TriggerEventRecord(
        event_id=make_event_id(trigger_id, "fired", None),
        trigger_id=trigger_id,
        task=TASK,
        status="fired",
        **fields,
    )


async def test_publish_routes_each_record_and_acks_states_before_runs(sched: Scheduler) -> None:
    cancel = CancelRequest(trigger_id="tid", task=TASK)
    start = RunTask(task=TASK, mode="start", operator="x.Op", worker_queue="gpu")
    resume = RunTask(task=TASK, mode="resume", operator="x.Op")
    letter = DeadLetter(topic="p.tasks", partition=0, offset=3, error="bad", error_type="E")
    await sched.writers[0].chain.publish(
        [Emit(state("queued")), Emit(start), Emit(resume), Emit(cancel, queue="slow")], [letter]
    )
    log = journal(sched)
    ti = TASK.ti_key.encode()
    assert log[:2] == [("send", "p.defer.slow", b"tid"), ("ack", "p.defer.slow", b"tid")]
    assert log[2:6] == [
        ("send", "p.tasks", ti),
        ("send", "p.dead", None),
        ("ack", "p.tasks", ti),
        ("ack", "p.dead", None),
    ], "task states (and dead letters) are acknowledged before any run is sent"
    assert [entry for entry in log[6:] if entry[0] == "send"] == [
        ("send", "p.queue.gpu", ti),
        ("send", "p.queue.resumes", ti),
    ]
    assert sched.published == 5
    await sched.writers[0].chain.publish([Emit(start)])
    ensured = [name for names in sched.ensured for name in names]  # type: ignore[attr-defined]
    assert ensured.count("p.queue.gpu") == 1, "a new worker queue's topics are created once"


async def test_decisions_of_a_folded_record_are_published(sched: Scheduler) -> None:
    assert sched.fold.task(TASK.ti_key.encode(), encode(state()), live=True) is None
    await sched.writers[0].chain.publish(admitted(sched))
    log = journal(sched)
    sends = [(topic, key) for kind, topic, key in log if kind == "send"]
    assert sends == [("p.tasks", TASK.ti_key.encode()), ("p.queue.gpu", TASK.ti_key.encode())]


async def test_a_wave_goes_out_as_one_batch_per_partition(sched: Scheduler) -> None:
    producer = producer_of(FakeKafka(partitions=3), max_batch_records=2)
    sched.producer._producers = [producer]
    tasks = [TaskKey(dag_id="d", task_id="t", run_id=f"r{i}") for i in range(7)]
    chain = sched.writers[0].chain
    await chain.publish([Emit(TaskStateRecord(task=t, state="queued")) for t in tasks])
    expected: dict[int, int] = {}
    for task in tasks:
        p = partition_for(task.ti_key.encode(), 3)
        expected[p] = expected.get(p, 0) + 1
    sent: dict[int, int] = {}
    for topic, partition, count in producer.batches:
        assert topic == "p.tasks"
        assert count <= 2, "a full batch is sent and the next one started"
        sent[partition] = sent.get(partition, 0) + count
    assert sent == expected, "each record in the batch of the partition its key hashes to"
    assert len(producer.batches) == sum((count + 1) // 2 for count in expected.values())


async def test_a_batch_handed_over_while_one_is_sending_goes_out_after_it(
    sched: Scheduler,
) -> None:
    first, second = (TaskKey(dag_id="d", task_id="t", run_id=f"r{i}") for i in range(2))
    chain = sched.writers[0].chain
    sending = chain.start([Emit(TaskStateRecord(task=first, state="queued"))])
    await asyncio.sleep(0)  # the first batch's task takes its first step: it is sending
    after = chain.start([Emit(TaskStateRecord(task=second, state="queued"))])
    assert after is not sending, "a batch handed over while one is sending waits behind it"
    await chain.settle()
    log = journal(sched)
    assert log == [
        ("send", "p.tasks", first.ti_key.encode()),
        ("ack", "p.tasks", first.ti_key.encode()),
        ("send", "p.tasks", second.ti_key.encode()),
        ("ack", "p.tasks", second.ti_key.encode()),
    ], "the second batch is sent only once the first is acknowledged"
    assert sched.published == 2


async def test_batches_handed_over_while_one_waits_join_it_in_order(sched: Scheduler) -> None:
    first, second, third = (TaskKey(dag_id="d", task_id="t", run_id=f"r{i}") for i in range(3))
    chain = sched.writers[0].chain
    sending = chain.start([Emit(TaskStateRecord(task=first, state="queued"))])
    await asyncio.sleep(0)  # the first batch is sending
    waiting = chain.start([Emit(TaskStateRecord(task=second, state="queued"))])
    joined = chain.start([Emit(TaskStateRecord(task=third, state="queued"))])
    assert joined is waiting is not sending, "the third batch joins the one still waiting"
    await chain.settle()
    log = journal(sched)
    assert [entry for entry in log if entry[0] == "send"] == [
        ("send", "p.tasks", first.ti_key.encode()),
        ("send", "p.tasks", second.ti_key.encode()),
        ("send", "p.tasks", third.ti_key.encode()),
    ], "the joined batches' records go out in the order they were handed over"
    assert log.index(("ack", "p.tasks", first.ti_key.encode())) < log.index(
        ("send", "p.tasks", second.ti_key.encode())
    ), "the joined batch is sent only once the one before it is acknowledged"
    assert sched.published == 3


async def test_nothing_goes_out_after_a_batch_that_failed(
    sched: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    async def refused(batch: Any, offsets: Any) -> None:
        calls.append(len(calls))
        raise KafkaConnectionError("broker gone")

    monkeypatch.setattr(sched.producer, "write", refused)
    failed = sched.writers[0].chain.start([Emit(TaskStateRecord(task=TASK, state="queued"))])
    after = sched.writers[0].chain.start([Emit(TaskStateRecord(task=TASK, state="running"))])
    assert failed is not None
    assert after is not None
    with pytest.raises(SchedulerError, match="broker gone"):
        await after
    assert failed.done()
    assert isinstance(failed.exception(), SchedulerError)
    assert calls == [0], "the batch after the failed one was never handed to the producer"


async def test_own_writes_read_back_are_folded_without_decoding(
    sched: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched.fold.task(TASK.ti_key.encode(), encode(state()), live=True)
    await sched.writers[0].chain.publish(admitted(sched))
    [(value, queued)] = sched.fold.written.items()
    assert queued.state == "queued"

    def no_decoding(value: bytes, kind: Any) -> Any:
        raise AssertionError("an own write was decoded")

    monkeypatch.setattr("deferline.runners.scheduler._fold.read_as", no_decoding)
    assert sched.fold.task(TASK.ti_key.encode(), value, live=True) is None
    assert sched.fold.written == {}
    assert sched.table._views[TASK.ti_key].inflight == (), "read back: no longer in flight"
    assert sched.table.get(TASK.ti_key) == queued


async def test_a_released_partition_leaves_nothing_behind(sched: Scheduler) -> None:
    sched.fold.task(TASK.ti_key.encode(), encode(state()), live=True)
    await sched.writers[0].chain.publish(admitted(sched))
    [value] = sched.fold.written
    await sched.membership.release(0)
    assert sched.fold.written == {}
    assert len(sched.table) == 0, "its tasks are dropped"
    assert sched.table.pool_usage()["default_pool"] == (0, 1), "and their slots freed"
    assert 0 not in sched.writers
    assert sched.producer._producers, "the member's producer stays, for the others"
    # Read back afterwards (the partition came back): decoded like any record.
    assert sched.fold.task(TASK.ti_key.encode(), value, live=True) is None
    assert sched.table._views[TASK.ti_key].inflight == ()


def test_bad_task_records_are_dead_lettered_only_when_read_live(sched: Scheduler) -> None:
    assert sched.fold.task(b"k", b"{not json", live=True) is not None
    assert sched.fold.task(b"k", b"{not json", live=False) is None
    wrong_kind = encode(fired())
    error = sched.fold.task(b"k", wrong_kind, live=True)
    assert error is not None
    assert "task_state" in error
    assert sched.bad_records == 3
    assert len(sched.table) == 0


def test_bad_events_are_reported_and_never_folded(sched: Scheduler) -> None:
    assert sched.fold.event(encode(state()), ref=(TPS, 0)) is not None
    assert sched.fold.event(b"[]", ref=(TPS, 1)) is not None
    assert sched.fold.event(None, ref=(TPS, 2)) is None
    assert sched.table.pending_events == 0


def test_tombstone_forgets_the_task_and_frees_its_slot(sched: Scheduler) -> None:
    sched.fold.task(b"k", encode(state()), live=False)
    admitted(sched)
    assert sched.table.pool_usage()["default_pool"] == (1, 1)
    sched.fold.task(TASK.ti_key.encode(), None, live=False)
    assert TASK.ti_key not in sched.table
    assert sched.table.pool_usage()["default_pool"] == (0, 1)


def test_commits_stop_at_the_first_pending_event(sched: Scheduler) -> None:
    other = TopicPartition("p.resume", 1)
    sched.offsets.done = {TPS: 10, other: 4}
    sched.fold.event(encode(fired()), ref=(TPS, 6))
    assert sched.table.pending_events == 1
    assert sched.offsets.committable(sched.table.pending_refs()) == {TPS: 6, other: 4}
    sched.offsets.committed.update(sched.offsets.committable(sched.table.pending_refs()))
    assert sched.offsets.committable(sched.table.pending_refs()) == {}, "nothing moved since"
    # The deferral arrives: the event applies and the partition can commit past it.
    deferred = state(
        "deferred", trigger_id=make_trigger_id(TASK, 0), next_method="done", source="worker"
    )
    sched.fold.task(b"k", encode(deferred), live=True)
    assert sched.table.pending_events == 0
    assert sched.offsets.committable(sched.table.pending_refs()) == {TPS: 10}


def test_metrics_are_read_from_the_table(sched: Scheduler) -> None:
    sched.fold.task(b"k", encode(state()), live=True)
    admitted(sched)
    sched.housekeeping.lag["events"] = 7
    sched.housekeeping.events_lag = {0: 3, 1: 4}
    text = generate_latest(sched.registry).decode()
    assert 'deferline_scheduler_runs_enqueued_total{mode="start"} 1.0' in text
    assert 'deferline_scheduler_pool_slots_used{pool="default_pool"} 1.0' in text
    assert 'deferline_scheduler_pool_slots{pool="default_pool"} 1.0' in text
    assert 'deferline_scheduler_tasks{state="queued"} 1.0' in text
    assert 'deferline_scheduler_lag{input="events"} 7.0' in text
    assert 'deferline_scheduler_partition_lag{partition="1"} 4.0' in text
    assert "deferline_scheduler_partitions_owned 1.0" in text
    assert "deferline_scheduler_duplicates_dropped_total 0.0" in text
    assert "deferline_scheduler_active 1.0" in text, "it owns partition 0"
    assert "deferline_scheduler_takeovers_total 0.0" in text
    assert "deferline_scheduler_partitions_fenced_total 0.0" in text
    assert "deferline_scheduler_transactions_total 0.0" in text
    assert 'deferline_scheduler_pool_ledger_slots{pool="default_pool"} 1.0' in text
    assert "deferline_scheduler_pool_ledger_owner 0.0" in text, "it has not led yet"
    assert 'deferline_scheduler_partition_events_total{partition="0",verdict="applied"} 0.0' in text
    sched.ownership.revoke()
    text = generate_latest(sched.registry).decode()
    assert "deferline_scheduler_active 0.0" in text, "a quiesced partition is not written for"
    assert "deferline_scheduler_partitions_owned 0.0" in text


def test_the_membership_metrics_keep_their_names_and_types(sched: Scheduler) -> None:
    """Read from the member core's figures, under the names the scheduler always had."""
    names = {
        "rebalances": "counter",
        "takeovers": "counter",
        "partitions_fenced": "counter",
        "partitions_owned": "gauge",
        "transactions": "counter",
        "transactions_fenced": "counter",
    }
    kinds = {metric.name: metric.type for metric in sched.registry.collect()}
    assert {name: kinds.get(f"deferline_scheduler_{name}") for name in names} == names


async def transactional(sched: Scheduler) -> FakeTransactionalProducer:
    """The member's producer in transactions, started: it holds the transactional id, and
    partition 0 has its last committed offset, as an acquisition leaves it."""
    member = sched.producer
    producer = FakeTransactionalProducer(
        FakeKafka(), member.transactional_id, max_batch_size=1 << 20
    )
    await producer.start()
    member._producers = [producer]
    member.transactional = True
    member._member = lambda: GroupMetadata("p.scheduler", 1, "member-a")  # in the group
    sched.offsets.committed[TPS] = 0
    return producer


async def test_a_transaction_carries_the_batch_and_the_offsets_it_consumed(
    sched: Scheduler,
) -> None:
    producer = await transactional(sched)
    sched.offsets.done = {TPS: 8}
    start = RunTask(task=TASK, mode="start", operator="x.Op", worker_queue="gpu")
    await sched.writers[0].chain.publish([Emit(state("queued")), Emit(start)], offsets=True)
    kinds = [kind for kind, _, _ in producer.journal if kind != "ack"]
    assert kinds == ["begin", "send", "send", "commit"]
    assert producer.kafka.offset_commits("p.scheduler") == [{TPS: 8}]
    assert sched.offsets.committed == {TPS: 8}
    await sched.writers[0].chain.publish([], offsets=True)
    assert producer.kafka.offset_commits("p.scheduler") == [{TPS: 8}], (
        "nothing new to commit: no empty transaction"
    )


async def test_a_round_the_group_fenced_drops_its_partition_without_writing(
    sched: Scheduler,
) -> None:
    producer = await transactional(sched)
    # The group went on without this member (it was paused past its session): the
    # coordinator refuses its offsets, and the round is aborted.
    producer.fail_offsets = [FencedByGroup("generation 3 is over")]
    sched.offsets.done = {TPS: 3}
    sched.fold.task(TASK.ti_key.encode(), encode(state()), live=True)
    chain = sched.writers[0].chain
    with pytest.raises(MemberFenced, match="group went on without this member"):
        await chain.publish(sched.table.drain(), offsets=True)
    assert (producer.commits, producer.aborts) == (0, 1)
    assert producer.kafka.offset_commits("p.scheduler") == []
    assert sched.offsets.committed == {TPS: 0}, (
        "offsets of a fenced round are not taken as committed"
    )
    assert chain.in_flight is not None
    await sched.writers.await_batches([chain.in_flight])
    assert sched.ownership.hold(0) is None, "another scheduler owns it now"
    assert 0 not in sched.writers
    assert len(sched.table) == 0
    assert sched.offsets.done == {}
    text = generate_latest(sched.registry).decode()
    assert "deferline_scheduler_partitions_fenced_total 1.0" in text
    assert "deferline_scheduler_transactions_fenced_total 1.0" in text


async def test_batches_handed_over_together_are_one_round_each_with_its_offset(
    sched: Scheduler,
) -> None:
    """Two partitions' batches in one transaction; a batch whose events moved no offset
    carries its partition's last committed one (its next owner then waits for the round)."""
    producer = await transactional(sched)
    sched.router.partitions = 2
    sched.writers.add(1)
    sched.ownership.revoke()
    sched.ownership.assign({0, 1})
    sched.ownership.acquired(1)
    other = TopicPartition(TPS.topic, 1)
    sched.offsets.committed[other] = 4
    sched.offsets.done = {TPS: 8}
    keys = [TaskKey(dag_id="d", task_id=f"t{n}", run_id="r") for n in range(40)]
    by_partition = {partition_for(k.ti_key.encode(), 2): k for k in keys}
    out = [Emit(TaskStateRecord(task=by_partition[p], state="queued")) for p in (0, 1)]
    await sched.writers.await_batches(sched.writers.publish(out, [], offsets=(0, 1)))
    kinds = [kind for kind, _, _ in producer.journal if kind not in ("ack", "send")]
    assert kinds == ["begin", "commit"], "one transaction for both partitions"
    assert producer.kafka.offset_commits("p.scheduler") == [{TPS: 8, other: 4}]


def test_finished_tasks_leave_memory_after_retention(sched: Scheduler) -> None:
    import datetime as dt

    t0 = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
    done = state("success", source="worker", updated_at=t0)
    sched.fold.task(b"k", encode(done), live=True)
    other = TaskKey(dag_id="d", task_id="other", run_id="r")
    later = TaskStateRecord(
        task=other, state="running", source="worker", updated_at=t0 + dt.timedelta(hours=2)
    )
    sched.fold.task(b"o", encode(later), live=True)
    assert sched.table.forget_finished(3 * 3600) == 0, "still within retention"
    assert sched.table.forget_finished(3600) == 1
    assert TASK.ti_key not in sched.table
    assert other.ti_key in sched.table, "a running task is never dropped"


def test_scheduler_decodes_what_it_encodes() -> None:
    record = state("queued")
    assert decode(encode(record)) == record


def test_command_line() -> None:
    runner = CliRunner()
    result = runner.invoke(scheduler_command, ["--help"])
    assert result.exit_code == 0
    assert "--pool NAME=SLOTS" in result.output
    result = runner.invoke(scheduler_command, ["--pool", "gpu"])
    assert result.exit_code == 2
    assert "expected NAME=SLOTS" in result.output
    result = runner.invoke(scheduler_command, ["--default-pool-slots", "lots"])
    assert result.exit_code == 2
    assert "'unlimited'" in result.output
    assert parse_pools(["a=1", "b=20"]) == {"a": 1, "b": 20}


@pytest.mark.parametrize("flag", ["--session-timeout", "--lease-timeout"])
def test_the_lease_timeout_flag_still_sets_the_session(
    flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deployments started with the lease's flag keep starting: it is the same group session."""
    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def capture(settings: Settings, **options: object) -> None:
        seen.update(options)
        raise Stop

    monkeypatch.setattr("deferline.runners.scheduler._scheduler.Scheduler", capture)
    result = CliRunner().invoke(scheduler_command, [flag, "7", "--no-checkpoint"])
    assert isinstance(result.exception, Stop), result.output
    assert seen["session_timeout"] == 7.0


async def test_the_fold_goes_on_while_earlier_batches_wait_for_the_broker(
    sched: Scheduler,
) -> None:
    producer = await transactional(sched)
    producer.begin_gate = asyncio.Event()  # the broker still completes an earlier transaction
    for phase in (Phase.JOINING, Phase.RUNNING):
        sched.phase.move(phase)
    kafka = producer.kafka
    for _ in range(6):  # unreadable events (each is dead-lettered), one per fetch
        kafka.append(TPS.topic, None, b"not an event", partition=TPS.partition)
    sched.intake.max_records = 1
    events = FakeConsumer(kafka)
    events.assign([TPS])
    loop = asyncio.create_task(sched.intake.run(events))
    try:
        ahead = BATCHES_AHEAD
        await until(lambda: events.fetches == ahead + 1)
        for _ in range(50):
            await asyncio.sleep(0)
        assert not producer.journal, "the first transaction is still waiting"
        assert events.fetches == ahead + 1, "one waiting to be sent, ahead more, then it waits"
        producer.begin_gate.set()
        await until(lambda: events.fetches > 6, what="a fetch past the last event")
        await sched.writers[0].chain.settle()
    finally:
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop
    committed = [offsets[TPS] for offsets in kafka.offset_commits("p.scheduler")]
    assert committed[0] == 1, "the first fold's transaction, sent alone"
    assert committed[1] == ahead + 1, "the folds made while it waited joined one transaction"
    assert committed == sorted(set(committed)), "in order, each once"
    assert committed[-1] == 6, "to the last fold"
    dead = [key for kind, topic, key in producer.journal if kind == "send" and topic == "p.dead"]
    assert len(dead) == 6


async def test_wants_go_with_their_partition_and_grants_with_partition_zero(
    sched: Scheduler,
) -> None:
    """A want is written in its task's partition's batch, the ledger owner's grant in
    partition 0's; read back, the grant starts the task in its own partition."""
    sched.router.partitions = 2
    channel = sched.pool_channel
    assert channel is not None
    channel.partitions = 2
    sched.writers.add(1)
    logs = {p: chain_writes(sched, p) for p in (0, 1)}
    sched.ownership.revoke()
    sched.ownership.assign({0, 1})
    sched.ownership.acquired(1)
    channel.own(1, sched.table)
    channel.ledger = PoolLedger(sched.table.pools)  # leading, as lead() leaves it
    channel._ledger_from = 0
    task = next(
        key
        for key in (TaskKey(dag_id="d", task_id=f"t{n}", run_id="r") for n in range(100))
        if partition_for(key.ti_key.encode(), 2) == 1
    )
    key = task.ti_key.encode()
    scheduled = TaskStateRecord(
        task=task,
        state="scheduled",
        source="client",
        resume=ResumeTarget(operator="x.Op", worker_queue="gpu"),
    )
    sched.fold.task(key, encode(scheduled), live=True)
    await sched.writers.await_batches(sched.writers.publish(sched.fold.drain(), []))
    pools = "p.scheduler.pools"
    assert ("send", pools, b"want/" + key) in logs[1]
    assert ("send", pools, b"want/" + key) not in logs[0]
    assert not any(entry[1] == pools for entry in logs[0]), "nothing granted before it is read"
    # The want read back from the pools topic: the ledger owner grants it in partition 0.
    claims = sched.table.pool_claims
    assert claims is not None
    want = claims.want(task.ti_key)
    assert want is not None
    assert channel.fold(0, b"want/" + key, encode(want)) == 1, "partition 1's table"
    await sched.writers.await_batches(sched.writers.publish(sched.fold.drain(), []))
    assert ("send", pools, b"grant/" + key) in logs[0], "granted by the ledger owner"
    assert ("send", pools, b"grant/" + key) not in logs[1]
    assert [entry for entry in logs[1] if entry[1] == "p.queue.gpu"] == [], "not started yet"
    # The grant read back: the task starts, in partition 1.
    grant = channel.ledger.grant(task.ti_key)
    assert grant is not None
    assert channel.fold(1, b"grant/" + key, encode(grant)) == 1
    await sched.writers.await_batches(sched.writers.publish(sched.fold.drain(), []))
    assert ("send", "p.queue.gpu", key) in logs[1]
    assert sched.table.get(task.ti_key).state == "queued"  # type: ignore[union-attr]
