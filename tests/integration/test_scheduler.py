"""The scheduler on a real broker, driven by hand-written worker and triggerer records."""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import orjson
import pytest
from aiokafka import TopicPartition
from deferline.engine import FAIL_METHOD
from deferline.replay import ReplaySession, parse_subject
from deferline.runners.scheduler import Scheduler
from deferline.runners.scheduler.testing import read_as
from deferline.runners.testing import group_generation
from deferline.schemas import (
    CancelRequest,
    DeadLetter,
    SchemaError,
    TriggerEventRecord,
    decode,
    encode,
    make_trigger_id,
)
from deferline.topics import Settings, make_consumer, partition_for

from tests._until import until

from ._taskflow import TaskFlow, task_key
from ._triggerer_help import TopicReader

pytestmark = pytest.mark.integration

FAST: dict[str, Any] = {"orphan_check_interval": 0.3, "commit_interval": 0.1}


async def barrier(flow: TaskFlow, scheduler: Scheduler) -> None:
    """Push one more deferral through the scheduler; what was read before it is settled."""
    sentinel = task_key(f"sentinel-{uuid.uuid4().hex[:6]}")
    await flow.defer(sentinel, resume=None)
    await until(lambda: scheduler.table.get(sentinel.ti_key) is not None, within=20, interval=0.02)
    await flow.fire(sentinel)
    await until(
        lambda: getattr(scheduler.table.get(sentinel.ti_key), "state", "") == "scheduled",
        within=20,
        interval=0.02,
    )
    await flow.wait_for(lambda: getattr(flow.latest(sentinel), "state", "") == "scheduled")


async def test_defer_fire_resume(settings: Settings) -> None:
    async with TaskFlow(settings, queues=["slow"]) as flow, Scheduler(settings, **FAST) as sched:
        await sched.wait_active()
        a, b = task_key("a"), task_key("b")
        await flow.submit(a, op_kwargs={"x": 1})
        await flow.submit(b)
        [start] = await flow.wait_for(lambda: flow.runs_of(a, "start"))
        assert start.operator == "pkg.Op"
        assert start.op_kwargs == {"x": 1}
        assert [t for t, r in flow.runs if r is start] == [flow.names.work()]
        assert (await flow.wait_state(a, "queued")).source == "scheduler"
        for task, queue in ((a, None), (b, "slow")):
            await flow.worker_state(task, "running")
            await flow.defer(task, queue=queue)
        await flow.fire(a, payload={"ok": 1})
        await flow.fire(b, queue="slow")  # on resume.slow and tasks.events, as a triggerer
        [resume] = await flow.wait_for(lambda: flow.runs_of(a, "resume"))
        assert [t for t, r in flow.runs if r is resume] == [flow.names.resumes()]
        assert resume.next_method == "execute_complete"
        assert resume.next_kwargs == {"seq": 0}
        assert resume.event == {"ok": 1}
        assert resume.trigger_id == make_trigger_id(a, 0)
        queued = await flow.wait_state(a, "queued", "running")
        assert queued.event == {"ok": 1}
        assert queued.next_method == "execute_complete"
        await flow.wait_for(lambda: flow.runs_of(b, "resume"))
        # Every partition of tasks.events is read, each folded to its end.
        await until(
            lambda: sched.housekeeping.events_lag == dict.fromkeys(range(settings.partitions), 0),
            within=20,
            interval=0.02,
        )
        await flow.worker_state(a, "running", trigger_id=resume.trigger_id, defer_seq=0)
        await flow.worker_state(a, "success")
        await until(
            lambda: getattr(sched.table.get(a.ti_key), "state", "") == "success",
            within=20,
            interval=0.02,
        )
        assert sched.table.pool_usage()["default_pool"][0] == 1, "only b holds a slot now"


async def test_injected_duplicate_events_are_never_applied(settings: Settings) -> None:
    async with TaskFlow(settings) as flow, Scheduler(settings, metrics_port=0, **FAST) as sched:
        await sched.wait_active()
        a = task_key("a")
        await flow.submit(a)
        await flow.wait_for(lambda: flow.runs_of(a, "start"))
        await flow.worker_state(a, "running")
        await flow.defer(a)
        await flow.fire(a)
        await flow.wait_for(lambda: flow.runs_of(a, "resume"))
        for _ in range(4):
            await flow.fire(a)  # the same event again (a second copy of the trigger)
        await flow.fire(a, payload={"another": "payload"})
        await until(lambda: sched.table.counters.events_duplicate == 5, within=20, interval=0.02)
        await barrier(flow, sched)
        assert len(flow.runs_of(a, "resume")) == 1
        assert sched.table.counters.events_applied == 2  # a and the barrier's sentinel
        url = f"http://127.0.0.1:{sched.metrics_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            text = await response.text()
        assert "deferline_scheduler_duplicates_dropped_total 5.0" in text
        assert 'deferline_scheduler_runs_enqueued_total{mode="resume"} 1.0' in text
        assert 'deferline_scheduler_pool_slots_used{pool="default_pool"} 1.0' in text


async def test_event_read_before_its_deferral_waits_for_it(settings: Settings) -> None:
    # An event waits for its deferral until the next orphan check finds the tasks topic
    # caught up without it: checks far apart here, so the test's own writes cannot lose
    # that race (the orphan drop has its own tests).
    slow_orphans = {**FAST, "orphan_check_interval": 120.0}
    async with TaskFlow(settings) as flow, Scheduler(settings, **slow_orphans) as sched:
        await sched.wait_active()
        a = task_key("a")
        await flow.submit(a)
        await flow.wait_for(lambda: flow.runs_of(a, "start"))
        await flow.fire(a)
        await until(lambda: sched.table.pending_events == 1, within=20, interval=0.02)
        await flow.worker_state(a, "running")
        await flow.defer(a)
        await flow.wait_for(lambda: flow.runs_of(a, "resume"))
        assert sched.table.pending_events == 0
        assert sched.table.counters.events_orphaned == 0


async def test_timed_out_and_failed_events_resume_into_fail(settings: Settings) -> None:
    async with TaskFlow(settings) as flow, Scheduler(settings, **FAST) as sched:
        await sched.wait_active()
        a, b = task_key("a"), task_key("b")
        for task in (a, b):
            await flow.submit(task)
            await flow.wait_for(lambda t=task: flow.runs_of(t, "start"))  # type: ignore[misc]
            await flow.defer(task)
        await flow.fire(a, status="timed_out", payload=None)
        await flow.fire(b, status="failed", payload=None, error="boom", traceback="tb")
        [ra] = await flow.wait_for(lambda: flow.runs_of(a, "resume"))
        [rb] = await flow.wait_for(lambda: flow.runs_of(b, "resume"))
        assert ra.next_method == FAIL_METHOD
        assert rb.next_method == FAIL_METHOD
        assert ra.next_kwargs is not None
        assert ra.next_kwargs["status"] == "timed_out"
        assert rb.next_kwargs is not None
        assert rb.next_kwargs["error"] == "Trigger failure: boom"


async def test_trigger_outcome_ends_the_task_without_a_worker(settings: Settings) -> None:
    async with TaskFlow(settings) as flow, Scheduler(settings, **FAST) as sched:
        await sched.wait_active()
        a = task_key("a")
        await flow.submit(a)
        await flow.wait_for(lambda: flow.runs_of(a, "start"))
        await flow.defer(a)
        await flow.fire(a, task_outcome="skipped", payload={"why": "nothing to do"})
        done = await flow.wait_state(a, "skipped")
        assert done.source == "scheduler"
        assert done.event == {"why": "nothing to do"}
        await barrier(flow, sched)
        assert flow.runs_of(a, "resume") == []


async def test_clear_while_deferred_cancels_the_trigger(settings: Settings) -> None:
    async with TaskFlow(settings, queues=["slow"]) as flow, Scheduler(settings, **FAST) as sched:
        await sched.wait_active()
        a = task_key("a")
        await flow.submit(a)
        await flow.wait_for(lambda: flow.runs_of(a, "start"))
        await flow.defer(a, queue="slow")
        await until(
            lambda: getattr(sched.table.get(a.ti_key), "state", "") == "deferred",
            within=20,
            interval=0.02,
        )
        await flow.put(
            flow.names.tasks,
            a.ti_key,
            flow.latest(a).model_copy(  # type: ignore[union-attr]
                update={"state": "removed", "source": "client", "reason": "cleared by test"}
            ),
        )
        [cancel] = await flow.wait_for(lambda: flow.cancels)
        assert cancel.trigger_id == make_trigger_id(a, 0)
        assert cancel.reason == "cleared by test"
        await flow.fire(a, status="cancelled", queue="slow", payload={"reason": "cleared"})
        await flow.fire(a, queue="slow")  # a late fire of a zombie copy
        await until(lambda: sched.table.counters.events_cancelled == 1, within=20, interval=0.02)
        await until(lambda: sched.table.counters.events_duplicate == 1, within=20, interval=0.02)
        await barrier(flow, sched)
        assert flow.runs_of(a, "resume") == []
        assert flow.latest(a).state == "removed"  # type: ignore[union-attr]
        assert sched.table.pool_usage()["default_pool"][0] == 0


async def test_resumes_bypass_a_pool_saturated_by_new_tasks(settings: Settings) -> None:
    pools = {"p": 2}
    async with TaskFlow(settings) as flow, Scheduler(settings, pools=pools, **FAST) as sched:
        await sched.wait_active()
        held = [task_key("held-0"), task_key("held-1")]
        for task in held:
            await flow.submit(task, pool="p")
            await flow.wait_for(lambda t=task: flow.runs_of(t, "start"))  # type: ignore[misc]
            await flow.worker_state(task, "running")
            await flow.defer(task)
        flood = [task_key(f"new-{n}") for n in range(30)]
        for task in flood:
            await flow.submit(task, pool="p", priority_weight=100)
        await until(
            lambda: sched.table.count_by_state().get("scheduled") == 30, within=20, interval=0.02
        )
        await flow.fire(held[0])
        [resume] = await flow.wait_for(lambda: flow.runs_of(held[0], "resume"))
        assert resume.pool == "p"
        assert not any(flow.runs_of(t) for t in flood), "new work waits for the pool"
        assert sched.table.pool_usage()["p"] == (2, 2)
        await flow.worker_state(held[0], "running", trigger_id=resume.trigger_id)
        await flow.worker_state(held[0], "success")
        await flow.wait_for(lambda: sum(bool(flow.runs_of(t)) for t in flood) == 1)
        await barrier(flow, sched)
        assert sum(bool(flow.runs_of(t)) for t in flood) == 1, "exactly the freed slot"


async def test_direct_resume_events(settings: Settings) -> None:
    async with TaskFlow(settings) as flow, Scheduler(settings, **FAST) as sched:
        await sched.wait_active()
        a, b = task_key("a"), task_key("b")
        for task in (a, b):
            await flow.submit(task)
            await flow.wait_for(lambda t=task: flow.runs_of(t, "start"))  # type: ignore[misc]
            await flow.defer(task)
        # a: the event arrives while a is deferred; the triggerer already enqueued the run.
        await flow.fire(a, resumed_directly=True)
        queued = await flow.wait_state(a, "queued")
        assert queued.event_id is not None
        assert queued.source == "scheduler"
        # b: the worker ran the direct resume before the scheduler read the event.
        trigger_b = make_trigger_id(b, 0)
        await flow.worker_state(b, "running", trigger_id=trigger_b, defer_seq=0)
        await flow.worker_state(b, "success")
        await until(
            lambda: getattr(sched.table.get(b.ti_key), "state", "") == "success",
            within=20,
            interval=0.02,
        )
        await flow.fire(b, resumed_directly=True)
        await flow.fire(b, resumed_directly=True)
        await until(lambda: sched.table.counters.events_direct == 1, within=20, interval=0.02)
        await until(lambda: sched.table.counters.events_duplicate == 1, within=20, interval=0.02)
        await barrier(flow, sched)
        assert flow.runs_of(a, "resume") == []
        assert flow.runs_of(b, "resume") == []
        assert flow.latest(b).state == "success"  # type: ignore[union-attr]


@pytest.mark.brokers_differ(
    "without transactions (Tansu) a takeover re-reads its partitions and re-sends"
)
async def test_restart_rebuilds_state_from_the_topics(settings: Settings) -> None:
    pools = {"p": 2}
    a, b, c = task_key("a"), task_key("b"), task_key("c")
    async with TaskFlow(settings) as flow:
        async with Scheduler(settings, pools=pools, **FAST) as first:
            await first.wait_active()
            for task in (a, b, c):
                await flow.submit(task, pool="p")
            await flow.wait_for(lambda: flow.runs_of(a) and flow.runs_of(b))
            await flow.worker_state(a, "running")
            await flow.worker_state(a, "success")
            await flow.wait_for(lambda: flow.runs_of(c, "start"))
            await flow.worker_state(b, "running")
            await flow.defer(b)
            await until(
                lambda: getattr(first.table.get(b.ti_key), "state", "") == "deferred",
                within=20,
                interval=0.02,
            )
            before = first.table.snapshot()
            usage = first.table.pool_usage()
            runs_before = len(flow.runs)
        async with Scheduler(settings, pools=pools, **FAST) as second:
            await second.wait_active()
            assert second.recovered_records >= 8
            assert second.table.snapshot() == before
            assert second.table.pool_usage() == usage
            await flow.fire(b)  # the rebuilt deferral is resumed by the new process
            await flow.wait_for(lambda: flow.runs_of(b, "resume"))
            await flow.wait_state(b, "queued")
            await barrier(flow, second)
            after = second.table.snapshot()
            runs_after = len(flow.runs)
            assert runs_after == runs_before + 1, "nothing decided twice"
        # A fresh group replays the resume topic from its start: same state, nothing applied.
        fresh = f"{settings.topic_prefix}replay-{uuid.uuid4().hex[:6]}"
        async with Scheduler(settings, pools=pools, group_id=fresh, **FAST) as third:
            await third.wait_active()
            counters = third.table.counters
            await until(
                lambda: counters.events_duplicate + counters.resends >= 2, within=20, interval=0.02
            )
            assert third.table.snapshot() == after
            assert counters.events_applied == 0
            await barrier(flow, third)
            # Without transactions, a task still queued on an event read again gets the same
            # RunTask again (a worker ignores a copy); nothing else is sent.
            assert counters.resends == 0 or not third.transactional
            assert len(flow.runs) == runs_after + counters.resends


@pytest.mark.brokers_differ(
    "an orphan's offset commits in a transaction on Kafka, in the group on Tansu"
)
async def test_event_without_deferral_is_dead_lettered_named_and_committed(
    settings: Settings,
) -> None:
    async with (
        TaskFlow(settings) as flow,
        Scheduler(settings, **FAST) as sched,
        TopicReader(settings, flow.names.dead) as dead,
    ):
        await sched.wait_active()
        ghost = task_key("ghost")
        record = await flow.fire(ghost)
        await until(lambda: sched.table.counters.events_orphaned == 1, within=10, interval=0.02)
        assert sched.table.pending_events == 0
        await until(
            lambda: dead.values(), within=10, interval=0.05, what="the orphan is dead-lettered"
        )
        [letter] = dead.values()
        assert isinstance(letter, DeadLetter)
        assert (letter.topic, letter.offset) == (flow.names.task_events, 0)
        assert letter.partition == _partition_of(flow, ghost.ti_key)
        assert (letter.error_type, letter.trigger_id, letter.task) == (
            "OrphanEvent",
            record.trigger_id,
            ghost,
        )
        assert "no deferral on the tasks topic matches this event" in letter.error
        assert "the task is not on the tasks topic" in letter.error
        assert letter.value is not None
        assert decode(letter.value) == record
        async with ReplaySession(settings, live=False) as session:
            verdict, _ = await session.why(parse_subject(record.trigger_id))
        assert verdict.cause == "dead_lettered"
        assert "OrphanEvent" in verdict.summary
        consumer = make_consumer(settings, group_id=sched.group_id)
        await consumer.start()
        try:
            tp = TopicPartition(flow.names.task_events, _partition_of(flow, ghost.ti_key))

            async def committed() -> int:
                return (await consumer.committed(tp)) or 0

            await until(committed, within=10, interval=0.05, what="the orphan's offset committed")
        finally:
            await consumer.stop()


async def test_unreadable_events_are_dead_lettered_with_the_models_reason(
    settings: Settings,
) -> None:
    async with (
        TaskFlow(settings) as flow,
        Scheduler(settings, **FAST) as sched,
        TopicReader(settings, flow.names.dead) as dead,
    ):
        await sched.wait_active()
        task = task_key("bad-events")
        await flow.submit(task)
        await flow.wait_state(task, "queued")
        await flow.worker_state(task, "running")
        await flow.defer(task)
        trigger_id = make_trigger_id(task, 0)
        usual = orjson.loads(
            encode(
                TriggerEventRecord(event_id="e", trigger_id=trigger_id, task=task, status="fired")
            )
        )
        bad = [
            b"\x00 not json at all",
            orjson.dumps(usual | {"status": "exploded"}),
            orjson.dumps(usual | {"payload": {"__type": "datetime", "__var": "yesterday"}}),
            orjson.dumps(usual | {"task": {"dag_id": "d/x", "task_id": "t", "run_id": "r"}}),
            encode(CancelRequest(trigger_id=trigger_id, task=task)),
        ]
        for value in bad:  # on the partition of the good event that follows them
            await flow.put_bytes(flow.names.task_events, task.ti_key, value)
        await flow.fire(task)
        await flow.wait_for(lambda: flow.runs_of(task, "resume"))
        letters = await until(
            lambda: len(dead.values()) == len(bad) and dead.values(),
            within=10,
            interval=0.05,
            what="dead letters",
        )
        for letter, value in zip(sorted(letters, key=lambda d: d.offset), bad, strict=True):
            assert isinstance(letter, DeadLetter)
            with pytest.raises(SchemaError) as model:
                read_as(value, TriggerEventRecord)  # the model's own reading
            assert (letter.error_type, letter.error) == (
                "SchemaError",
                f"SchemaError: {model.value}",
            )
            assert (letter.topic, letter.value) == (flow.names.task_events, value)
        assert sched.bad_records == len(bad)


def _partition_of(flow: TaskFlow, key: str) -> int:
    return partition_for(key.encode(), flow.settings.partitions)


async def test_a_static_member_restarted_in_time_keeps_its_partitions(
    settings: Settings, broker_backend: str
) -> None:
    """With --group-instance-id, a scheduler restarted within its session timeout gets its
    partitions back in the same group generation: nobody else rebalances."""
    if broker_backend == "tansu":
        pytest.skip(
            "static membership: Tansu accepts group.instance.id but does not hand a rejoining "
            "static member its old place; the old member expires after the session timeout "
            "and the group rebalances"
        )
    static: dict[str, Any] = {"session_timeout": 30.0, **FAST}
    everything = list(range(settings.partitions))
    async with Scheduler(settings, group_instance_id="a", **static) as a:
        b = Scheduler(settings, group_instance_id="b", **static)
        async with b:
            await until(
                lambda: b.ready and a.owned and b.owned and sorted(a.owned + b.owned) == everything,
                within=60,
                interval=0.02,
            )
            owned, generation = b.owned, group_generation(b.clients.events)
            kept = a.owned
        again = Scheduler(settings, group_instance_id="b", **static)
        async with again:
            await until(lambda: again.owned == owned, within=30, interval=0.02)
            assert group_generation(again.clients.events) == generation, "no rebalance"
            assert a.owned == kept
            assert group_generation(a.clients.events) == generation
