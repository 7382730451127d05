"""The whole loop on a real broker: client → scheduler → worker → triggerer → scheduler → worker.

Real components run in this process (one triggerer, one scheduler, one worker); operators
come from ``deferline.engine.examples`` and ``tests.integration._e2e_ops``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import pytest
from aiokafka import TopicPartition
from deferline.client import Client
from deferline.engine import Pools
from deferline.runners.scheduler import Scheduler
from deferline.runners.triggerer import Triggerer, TriggererOptions
from deferline.runners.worker import Worker
from deferline.schemas import TaskKey, make_trigger_id
from deferline.topics import Settings, TopicNames, make_consumer

from tests._until import until

from . import _e2e_ops
from ._taskflow import TaskFlow

pytestmark = pytest.mark.integration

EXAMPLES = "deferline.engine.examples"
OPS = _e2e_ops.MODULE


@dataclass
class Deployment:
    client: Client
    scheduler: Scheduler
    triggerer: Triggerer
    worker: Worker
    flow: TaskFlow

    async def submit(self, name: str, operator: str, **options: object) -> TaskKey:
        return await self.client.submit(
            operator,
            dag_id="e2e",
            task_id=name,
            run_id="run1",
            **options,  # type: ignore[arg-type]
        )


def allow_test_code(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "allowed_trigger_prefixes": ["deferline.engine.triggers", OPS],
            "allowed_operator_prefixes": [EXAMPLES, OPS],
        }
    )


@contextlib.asynccontextmanager
async def deployment(
    settings: Settings,
    *,
    direct_resume: bool = False,
    pools: Pools | Mapping[str, int] | None = None,
    slots: int = 4,
) -> AsyncIterator[Deployment]:
    settings = allow_test_code(settings)
    options = TriggererOptions(
        direct_resume=direct_resume, session_timeout_ms=6000, checkpoint_interval=0.5
    )
    async with (
        TaskFlow(settings) as flow,
        Scheduler(settings, pools=pools, orphan_check_interval=0.5, commit_interval=0.2) as sched,
        Triggerer(settings, options) as triggerer,
        Worker(settings, slots=slots, poll_interval=0.02, graceful_timeout=5.0) as worker,
        Client(settings) as client,
    ):
        await sched.wait_active()
        yield Deployment(client, sched, triggerer, worker, flow)


async def test_task_lifecycles(settings: Settings) -> None:
    """Defer once, several times, time out, fail in the trigger, end from it, be cleared,
    and fail once then succeed on its retry."""
    async with deployment(settings) as d:
        once = await d.submit(
            "once", f"{EXAMPLES}.WaitOperator", op_kwargs={"seconds": 0.2, "result": {"n": 7}}
        )
        multi = await d.submit(
            "multi", f"{EXAMPLES}.MultiWaitOperator", op_kwargs={"waits": [0.1, 0.1, 0.1]}
        )
        timeout = await d.submit(
            "timeout", f"{EXAMPLES}.WaitOperator", op_kwargs={"seconds": 60, "timeout": 0.3}
        )
        explode = await d.submit("explode", f"{OPS}.ExplodeOperator")
        ended = await d.submit(
            "ended",
            f"{EXAMPLES}.WaitOperator",
            op_kwargs={"seconds": 0.2, "end_from_trigger": True},
        )
        cleared = await d.submit("cleared", f"{EXAMPLES}.WaitOperator", op_kwargs={"seconds": 60})
        flaky = await d.submit(
            "flaky", f"{EXAMPLES}.FlakyOperator", op_kwargs={"fail_tries": 1}, retries=1
        )

        flow = d.flow
        succeeded = await flow.wait_state(once, "success")
        assert succeeded.source == "worker"
        assert succeeded.xcoms == {"return_value": {"n": 7}}, "the return value reached tasks"
        assert len(flow.runs_of(once, "resume")) == 1

        await flow.wait_state(multi, "success")
        deferrals = [
            r.defer_seq for r in flow.tasks_log if r.task == multi and r.state == "deferred"
        ]
        assert deferrals == [0, 1, 2]
        assert [r.defer_seq for r in flow.runs_of(multi, "resume")] == [0, 1, 2]

        failed = await flow.wait_state(timeout, "failed")
        assert failed.reason is not None
        assert "TaskDeferralTimeout" in failed.reason

        failed = await flow.wait_state(explode, "failed")
        assert failed.reason is not None
        assert "kaboom" in failed.reason

        done = await flow.wait_state(ended, "success")
        assert done.source == "scheduler", "the trigger ended it, not a worker"
        assert flow.runs_of(ended, "resume") == []

        await flow.wait_state(cleared, "deferred")
        await d.client.clear(cleared, reason="no longer needed")
        trigger_id = make_trigger_id(cleared, 0)
        await flow.wait_for(
            lambda: any(e.trigger_id == trigger_id and e.status == "cancelled" for e in flow.events)
        )
        await until(
            lambda: d.scheduler.table.counters.events_cancelled == 1, within=10, interval=0.05
        )
        assert flow.latest(cleared).state == "removed"  # type: ignore[union-attr]
        assert flow.runs_of(cleared, "resume") == []
        retried = await flow.wait_state(flaky, "success")
        assert retried.task.try_number == 2
        assert any(r.task == flaky and r.state == "up_for_retry" for r in flow.tasks_log)
        assert d.scheduler.table.counters.retries == 1
        assert d.scheduler.table.counters.events_duplicate == 0
        assert d.scheduler.table.pool_usage()["default_pool"][0] == 0, "every slot came back"


async def test_resumes_go_ahead_of_new_work(settings: Settings) -> None:
    """With one worker slot and a backlog of new work, fired tasks resume next."""
    pools = Pools(slots={"held": 2}, default_slots=None)
    async with deployment(settings, pools=pools, slots=1) as d:
        held = [
            await d.submit(
                f"held-{n}", f"{EXAMPLES}.WaitOperator", op_kwargs={"seconds": 1.0}, pool="held"
            )
            for n in range(2)
        ]
        for task in held:
            await d.flow.wait_state(task, "deferred")
        # The "held" pool is full with deferred tasks: new work there waits for a slot.
        blocked = [
            await d.submit(
                f"blocked-{n}", f"{OPS}.SleepOperator", op_kwargs={"seconds": 0.0}, pool="held"
            )
            for n in range(5)
        ]
        flood = [
            await d.submit(f"flood-{n:02d}", f"{OPS}.SleepOperator", op_kwargs={"seconds": 0.1})
            for n in range(50)
        ]
        for task in held:
            await d.flow.wait_state(task, "success", within=30)
        started = [t for t in flood if d.flow.runs_of(t) and _ran(d.flow, t)]
        assert len(started) < 30, f"{len(started)} of 50 new tasks ran before the resumes"
        for task in blocked:
            await d.flow.wait_state(task, "success", within=30)
        await until(lambda: all(_done(d.flow, t) for t in flood), within=30, interval=0.05)


def _ran(flow: TaskFlow, task: TaskKey) -> bool:
    return any(r.task.ti_key == task.ti_key and r.state == "running" for r in flow.tasks_log)


def _done(flow: TaskFlow, task: TaskKey) -> bool:
    latest = flow.latest(task)
    return latest is not None and latest.state == "success"


async def test_direct_resume(settings: Settings) -> None:
    async with deployment(settings, direct_resume=True) as d:
        tasks = [
            await d.submit(f"direct-{n}", f"{EXAMPLES}.WaitOperator", op_kwargs={"seconds": 0.3})
            for n in range(5)
        ]
        for task in tasks:
            await d.flow.wait_state(task, "success")
        counters = d.scheduler.table.counters
        await until(
            lambda: counters.events_applied + counters.events_direct == 5, within=10, interval=0.05
        )
        assert counters.resumes == 0, "the triggerer enqueued every resume itself"
        assert all(len(d.flow.runs_of(t, "resume")) == 1 for t in tasks)
        assert d.worker.metrics.resumed == 5


async def group_lag(settings: Settings, group: str, topic: str) -> dict[int, int]:
    """Per partition of ``topic``: its end less ``group``'s committed offset, as
    ``kafka-consumer-groups`` and the console compute a lag. The end is the high watermark of
    a fetch response (Tansu's ListOffsets answers short of it: docs/operations.md, "Tansu
    notes")."""
    consumer = make_consumer(settings, group_id=group)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        committed = {tp: (await consumer.committed(tp)) or 0 for tp in tps}
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, committed[tp])
        ends: dict[TopicPartition, int] = {}
        while len(ends) < len(tps):
            await consumer.getmany(timeout_ms=200)
            ends.update({tp: end for tp in tps if (end := consumer.highwater(tp)) is not None})
        return {tp.partition: ends[tp] - committed[tp] for tp in tps}
    finally:
        await consumer.stop()


@pytest.mark.brokers_differ(
    "commits past transaction markers happen on Kafka only; Tansu commits offsets in the group"
)
async def test_at_rest_no_group_shows_lag(settings: Settings) -> None:
    """Once every event is folded, the scheduler group's committed offsets on tasks.events
    and the triggerer group's on defer are the partitions' ends. On Apache Kafka the
    triggerer writes events, their copies and its tombstones in transactions, so each
    partition ends with commit markers (one per transaction that touched it), which are no
    records: committed at the last record, a group would show that many records of lag for
    ever."""
    names = TopicNames(settings.topic_prefix)
    async with deployment(settings) as d:
        tasks = [
            await d.submit(f"rest-{n}", f"{EXAMPLES}.WaitOperator", op_kwargs={"seconds": 0.2})
            for n in range(24)
        ]
        for task in tasks:
            await d.flow.wait_state(task, "success")
        for group, topic in [("scheduler", names.task_events), ("triggerer", names.defer())]:
            await until(
                functools.partial(_no_lag, settings, f"{settings.topic_prefix}{group}", topic),
                within=20,
                interval=0.5,
                what=f"the {group} group's lag on {topic} came to 0",
            )
        # The triggerer's own lag gauge says the same, once its next commit is made.
        await until(
            lambda: not [row for lane in d.triggerer.lanes for row in lane.partitions() if row[3]],
            within=10,
            interval=0.05,
            what="deferline_triggerer_consumer_lag came to 0",
        )


async def _no_lag(settings: Settings, group: str, topic: str) -> bool:
    return not any((await group_lag(settings, group, topic)).values())
