"""Replay against a real broker: crafted topic histories, one per verdict, read back.

Each test produces what the parties would have written (worker, triggerer, scheduler) to a
real broker, sets up live consumer groups where the verdict depends on them, and asserts the
verdict and its evidence: record kinds, topics, partitions and offsets.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from deferline.replay import (
    ReplaySession,
    Subject,
    TopicReader,
    Verdict,
    VerdictKind,
    parse_subject,
)
from deferline.topics import (
    Settings,
    TopicNames,
    ensure_topics,
    make_consumer,
    make_producer,
    partition_for,
    topic_specs,
)

from tests._until import until
from tests.replay._history import History, at, task_key

pytestmark = pytest.mark.integration

NOW = at(3600)


def history(settings: Settings) -> History:
    return History(prefix=settings.topic_prefix, partitions=settings.partitions)


async def publish(settings: Settings, h: History) -> dict[tuple[str, int], list[int]]:
    """Create the topics and produce the writes in order; returns offsets per partition."""
    await ensure_topics(
        settings, topic_specs(settings, queues=[None, "gpu"], worker_queues=["default", "gpu"])
    )
    producer = make_producer(settings, linger_ms=5)
    offsets: dict[tuple[str, int], list[int]] = {}
    await producer.start()
    try:
        futures = [
            await producer.send(
                w.topic,
                w.value,
                key=w.key,
                partition=w.partition,
                timestamp_ms=w.timestamp_ms,
                headers=list(w.headers) or None,
            )
            for w in h.writes
        ]
        for w, fut in zip(h.writes, futures, strict=True):
            meta = await fut
            offsets.setdefault((w.topic, w.partition), []).append(meta.offset)
    finally:
        await producer.stop()
    return offsets


async def why(settings: Settings, subject: str, *, live: bool = True) -> Verdict:
    async with ReplaySession(settings, now=NOW, live=live) as session:
        verdict, _ = await session.why(parse_subject(subject))
    return verdict


@contextlib.asynccontextmanager
async def group_member(
    settings: Settings, group_id: str, topic: str, client_id: str
) -> AsyncIterator[AIOKafkaConsumer]:
    """A live member of ``group_id`` subscribed to ``topic`` that never reads or commits."""
    consumer = make_consumer(
        settings,
        topic,
        group_id=group_id,
        client_id=client_id,
        session_timeout_ms=10_000,
        heartbeat_interval_ms=500,
    )
    await consumer.start()
    try:
        await until(lambda: consumer.assignment(), within=30, interval=0.05, what="group joined")
        yield consumer
    finally:
        await consumer.stop()


def deferred(h: History, name: str = "t1", *, when: float = 2, **kwargs: Any):
    task = task_key(name)
    h.submit(task, 0)
    h.start(task, 1)
    return task, h.defer(task, when, **kwargs)


def evidence(verdict: Verdict, kind: str):
    found = [e for e in verdict.evidence if e.kind == kind]
    assert found, f"no {kind} evidence in {verdict.evidence}"
    return found[-1]


# -- verdicts ---------------------------------------------------------------------------------


@pytest.mark.tansu_first
async def test_never_requested(settings: Settings):
    h = history(settings)
    task, request = deferred(h, publish=False)
    offsets = await publish(settings, h)
    verdict = await why(settings, task.ti_key)
    assert verdict.kind is VerdictKind.NEVER_REQUESTED
    assert verdict.trigger_id == request.trigger_id
    ev = evidence(verdict, "task_state")
    tasks = TopicNames(settings.topic_prefix).tasks
    part = partition_for(task.ti_key.encode(), settings.partitions)
    assert ev.position is not None
    assert (ev.position.topic, ev.position.partition) == (tasks, part)
    assert ev.position.offset == offsets[(tasks, part)][-1]
    assert ev.at == at(2)


@pytest.mark.tansu_first
async def test_no_live_triggerer(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    offsets = await publish(settings, h)
    verdict = await why(settings, request.trigger_id)
    assert verdict.kind is VerdictKind.NO_LIVE_TRIGGERER
    req = evidence(verdict, "defer_request")
    defer = TopicNames(settings.topic_prefix).defer()
    part = partition_for(request.trigger_id.encode(), settings.partitions)
    assert req.position is not None
    assert (req.position.topic, req.position.partition) == (defer, part)
    assert req.position.offset == offsets[(defer, part)][0]
    assert verdict.task == task


@pytest.mark.brokers_differ(
    "a live group is tied to its topic by member assignment on Kafka, by committed offsets on Tansu"
)
async def test_no_triggerer_for_the_queue(settings: Settings):
    h = history(settings)
    task, _ = deferred(h, queue="gpu")
    await publish(settings, h)
    names = TopicNames(settings.topic_prefix)
    async with group_member(settings, f"{settings.topic_prefix}triggerer", names.defer(), "trig-a"):
        verdict = await why(settings, task.ti_key)
    assert verdict.kind is VerdictKind.NO_TRIGGERER_FOR_QUEUE
    assert verdict.facts["queue"] == "gpu"
    assert any(f"{settings.topic_prefix}triggerer" in e.note for e in verdict.evidence)


@pytest.mark.brokers_differ(
    "a live group is tied to its topic by member assignment on Kafka, by committed offsets on Tansu"
)
async def test_running_on_a_live_member(settings: Settings, broker_backend: str):
    h = history(settings)
    task, _ = deferred(h)
    await publish(settings, h)
    names = TopicNames(settings.topic_prefix)
    group = f"{settings.topic_prefix}triggerer"
    async with group_member(settings, group, names.defer(), "trig-a"):
        verdict = await why(settings, task.ti_key)
    assert verdict.kind is VerdictKind.RUNNING
    assert verdict.facts["group"] == group
    # A timer due 60 s after the deferral at t=2, read at t=3600.
    assert verdict.facts["overdue_s"] == pytest.approx(3600 - 62)
    if broker_backend != "tansu":  # Tansu does not report member assignments
        assert verdict.facts["member"] == "trig-a"


@pytest.mark.brokers_differ(
    "a live group is tied to its topic by member assignment on Kafka, by committed offsets on Tansu"
)
async def test_fired_but_the_scheduler_has_not_read_it(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    h.emit(request, 70, member="trig-a")
    offsets = await publish(settings, h)
    names = TopicNames(settings.topic_prefix)
    async with group_member(
        settings, f"{settings.topic_prefix}scheduler", names.task_events, "sched-1"
    ):
        verdict = await why(settings, task.ti_key)
    assert verdict.kind is VerdictKind.FIRED_NOT_APPLIED
    assert verdict.cause == "scheduler_lag"
    event, copy = [e for e in verdict.evidence if e.kind == "trigger_event"]
    part = partition_for(request.trigger_id.encode(), settings.partitions)
    assert event.position is not None
    assert (event.position.topic, event.position.partition) == (names.resume(), part)
    assert event.position.offset == offsets[(names.resume(), part)][0]
    task_part = partition_for(task.ti_key.encode(), settings.partitions)
    assert copy.position is not None
    assert (copy.position.topic, copy.position.partition) == (names.task_events, task_part)
    assert copy.position.offset == offsets[(names.task_events, task_part)][0]
    assert verdict.facts["member"] == "trig-a"
    assert verdict.since == at(70)


@pytest.mark.tansu_first
async def test_fired_but_never_copied_to_the_tasks_partition(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    h.emit(request, 70, member="trig-a", copied=False)
    offsets = await publish(settings, h)
    verdict = await why(settings, task.ti_key)
    assert verdict.kind is VerdictKind.EVENT_NOT_COPIED
    assert verdict.cause == "tombstoned"
    assert "redrive --force" in verdict.summary
    event = evidence(verdict, "trigger_event")
    names = TopicNames(settings.topic_prefix)
    part = partition_for(request.trigger_id.encode(), settings.partitions)
    assert event.position is not None
    assert (event.position.topic, event.position.partition) == (names.resume(), part)
    assert event.position.offset == offsets[(names.resume(), part)][0]


@pytest.mark.tansu_first
async def test_fired_with_no_scheduler(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    h.emit(request, 70)
    await publish(settings, h)
    verdict = await why(settings, task.ti_key)
    assert verdict.kind is VerdictKind.FIRED_NOT_APPLIED
    assert verdict.cause == "no_scheduler"


@pytest.mark.tansu_first
async def test_fired_after_the_task_moved_on(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    h.worker_state(task, "removed", 10)
    retry = task.model_copy(update={"try_number": 2})
    h.submit(retry, 11)
    h.start(retry, 12)
    h.emit(request, 70)
    await publish(settings, h)
    verdict = await why(settings, request.trigger_id, live=False)
    assert verdict.kind is VerdictKind.FIRED_NOT_APPLIED
    assert verdict.cause == "stale"
    assert verdict.state == "running"


@pytest.mark.tansu_first
async def test_duplicate_event_is_named(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    h.schedule(h.emit(request, 70, member="trig-a"))
    h.worker_state(task, "running", 71)
    h.emit(request, 72, member="trig-b", payload={"late": True}, tombstone=False)
    await publish(settings, h)
    verdict = await why(settings, request.trigger_id, live=False)
    assert verdict.kind is VerdictKind.RESUMED
    assert verdict.facts["duplicates_dropped"] == 1
    dup = [e for e in verdict.evidence if "duplicate" in e.note]
    assert len(dup) == 1
    assert "trig-b" in (dup[0].detail or "")


@pytest.mark.tansu_first
async def test_timed_out(settings: Settings):
    h = history(settings)
    task, request = deferred(h, timeout_at=at(30))
    h.schedule(h.emit(request, 30.2, status="timed_out", payload={"timeout": True}))
    await publish(settings, h)
    verdict = await why(settings, task.ti_key, live=False)
    assert verdict.kind is VerdictKind.TIMED_OUT
    assert verdict.facts["timeout_at"] == at(30)
    assert evidence(verdict, "trigger_event").at == at(30.2)


@pytest.mark.tansu_first
async def test_trigger_failed_with_traceback(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    tb = "Traceback (most recent call last):\n  ...\nConnectionError: refused"
    h.emit(
        request,
        40,
        status="failed",
        error="ConnectionError: refused",
        traceback=tb,
        payload={"error": "ConnectionError: refused"},
    )
    await publish(settings, h)
    verdict = await why(settings, task.ti_key, live=False)
    assert verdict.kind is VerdictKind.TRIGGER_FAILED
    assert verdict.facts["traceback"] == tb
    assert "refused" in verdict.summary


@pytest.mark.parametrize(
    ("error_type", "kind"),
    [
        ("TriggerNotAllowed", VerdictKind.CLASSPATH_NOT_ALLOWED),
        ("TriggerImportError", VerdictKind.IMPORT_ERROR),
        ("DecryptionError", VerdictKind.UNDECRYPTABLE_KWARGS),
    ],
)
@pytest.mark.tansu_first
async def test_dead_lettered(settings: Settings, error_type: str, kind: VerdictKind):
    h = history(settings)
    task, request = deferred(h, classpath="somewhere.else.Trigger")
    h.dead_letter(request, 3, error_type=error_type, error="refused", member="trig-a")
    await publish(settings, h)
    verdict = await why(settings, task.ti_key, live=False)
    assert verdict.kind is kind
    letter = evidence(verdict, "dead_letter")
    assert letter.position is not None
    assert letter.position.topic == TopicNames(settings.topic_prefix).dead
    assert verdict.facts["member"] == "trig-a"
    assert verdict.facts["classpath"] == "somewhere.else.Trigger"


@pytest.mark.tansu_first
async def test_cancelled(settings: Settings):
    h = history(settings)
    _, request = deferred(h)
    h.cancel(request, 20)
    h.schedule(h.emit(request, 20.5, status="cancelled", payload={"reason": "cleared"}))
    await publish(settings, h)
    verdict = await why(settings, request.trigger_id, live=False)
    assert verdict.kind is VerdictKind.CANCELLED
    assert verdict.state == "removed"
    assert {"cancel_request", "trigger_event"} <= {e.kind for e in verdict.evidence}


@pytest.mark.tansu_first
async def test_resumed_but_no_worker_for_its_queue(settings: Settings):
    h = history(settings)
    task, request = deferred(h, worker_queue="gpu")
    h.schedule(h.emit(request, 70))
    await publish(settings, h)
    verdict = await why(settings, task.ti_key)
    assert verdict.kind is VerdictKind.RESUME_NOT_PICKED_UP
    assert verdict.cause == "no_worker"
    run = evidence(verdict, "run_task")
    assert run.position is not None
    assert run.position.topic == TopicNames(settings.topic_prefix).resumes("gpu")


@pytest.mark.brokers_differ(
    "a live group is tied to its topic by member assignment on Kafka, by committed offsets on Tansu"
)
async def test_resumed_but_the_worker_queue_lags(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    h.schedule(h.emit(request, 70))
    await publish(settings, h)
    names = TopicNames(settings.topic_prefix)
    async with group_member(
        settings, f"{settings.topic_prefix}worker.default", names.resumes(), "worker-1"
    ):
        verdict = await why(settings, task.ti_key)
    assert verdict.kind is VerdictKind.RESUME_NOT_PICKED_UP
    assert verdict.cause == "queue_lag"
    assert verdict.facts["worker_lag_records"] >= 1


# -- reading ----------------------------------------------------------------------------------


async def test_replay_creates_no_group_and_commits_nothing(settings: Settings):
    h = history(settings)
    deferred(h)
    await publish(settings, h)
    from deferline.topics import make_admin

    admin = make_admin(settings)
    await admin.start()
    try:
        before = {g[0] for g in await admin.list_consumer_groups()}
        async with ReplaySession(settings, now=NOW) as session:
            await session.stuck(older_than=dt.timedelta(minutes=1))
            await session.why(Subject("x", trigger_id="x"))
        after = {g[0] for g in await admin.list_consumer_groups()}
    finally:
        await admin.close()
    assert {g for g in after - before if str(g).startswith(settings.topic_prefix)} == set()


@pytest.mark.tansu_first
async def test_stuck_lists_each_waiting_task_once_with_its_verdict(settings: Settings):
    h = history(settings)
    never, _ = deferred(h, "never", publish=False)
    waits, _ = deferred(h, "waits")
    fired, fired_request = deferred(h, "fired")
    h.emit(fired_request, 70)
    done, done_request = deferred(h, "done")
    h.schedule(h.emit(done_request, 70))
    h.worker_state(done, "success", 80)
    await publish(settings, h)
    async with ReplaySession(settings, now=NOW, live=False) as session:
        reports = await session.stuck(older_than=dt.timedelta(minutes=10))
        recent = await session.stuck(older_than=dt.timedelta(hours=1))
    kinds = {r.waiting.ti_key: r.verdict.kind for r in reports}
    assert kinds == {
        never.ti_key: VerdictKind.NEVER_REQUESTED,
        waits.ti_key: VerdictKind.WAITING,
        fired.ti_key: VerdictKind.FIRED_NOT_APPLIED,
    }
    assert recent == []


@pytest.mark.brokers_differ(
    "Tansu ignores the time of an offsets-for-times lookup; the per-record check must hold"
)
async def test_time_and_offset_bounds(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    h.emit(request, 70)
    await publish(settings, h)
    from deferline.replay import ReadBounds

    # Only records from t=60 on: the deferral is outside, the event inside.
    async with ReplaySession(
        settings, now=NOW, live=False, bounds=ReadBounds(since=at(60))
    ) as session:
        entries = await session.timeline(parse_subject(request.trigger_id))
    assert {e.kind for e in entries} == {"trigger_event", "tombstone"}
    async with ReplaySession(
        settings, now=NOW, live=False, bounds=ReadBounds(to_offset=0)
    ) as session:
        assert await session.timeline(parse_subject(task.ti_key)) == []


@pytest.mark.tansu_first
async def test_timeline_records_in_order_with_positions(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    h.schedule(h.emit(request, 70, member="trig-a"))
    h.worker_state(task, "running", 71)
    offsets = await publish(settings, h)
    async with ReplaySession(settings, now=NOW, live=False) as session:
        entries = await session.timeline(parse_subject(task.ti_key))
    kinds = [e.kind for e in entries]
    assert kinds[:3] == ["task_state", "task_state", "run_task"]  # scheduled, queued, start
    assert kinds.index("defer_request") < kinds.index("trigger_event") < kinds.index("tombstone")
    event = next(e for e in entries if e.kind == "trigger_event")
    assert event.owner == "trig-a"
    assert event.owner_exact
    assert event.decision == "applied"
    names = TopicNames(settings.topic_prefix)
    part = partition_for(request.trigger_id.encode(), settings.partitions)
    assert event.position.offset == offsets[(names.resume(), part)][0]
    times = [e.at for e in entries]
    assert times == sorted(times)  # type: ignore[type-var]
    request_entry = next(e for e in entries if e.kind == "defer_request")
    assert request_entry.owner == "trig-a"  # seen on that partition around that time


@pytest.mark.brokers_differ(
    "Tansu's ListOffsets answers short of the end; the end comes from a fetch's high watermark"
)
async def test_large_batches_are_read_to_the_end(settings: Settings):
    """Every record of a partition is read even when the broker reports a short end offset."""
    h = history(settings)
    tasks = [task_key(f"t{i}") for i in range(300)]
    for i, task in enumerate(tasks):
        h.submit(task, i / 100)
        h.start(task, 1 + i / 100)
        h.defer(task, 2 + i / 100)
    await publish(settings, h)
    async with ReplaySession(settings, now=NOW, live=False) as session:
        reports = await session.stuck(older_than=dt.timedelta(minutes=1))
    assert len(reports) == len(tasks)
    assert all(r.verdict.kind is VerdictKind.WAITING for r in reports)


@pytest.mark.tansu_first
async def test_a_reader_stopped_as_soon_as_it_started_closes_its_connections(settings: Settings):
    # aiokafka's stop() of a consumer without a group raises CancelledError when nothing ran
    # in between (its committed-offsets task was never started), before it closes anything.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        async with TopicReader(settings):
            pass
        gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
