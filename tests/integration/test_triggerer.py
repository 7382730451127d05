"""The triggerer against a real broker, in process: firing, cancel, bad input, checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from deferline.runners.triggerer import (
    LONG_POLL_MS,
    SHORT_WAIT_MS,
    Triggerer,
    TriggererOptions,
    answers_fetches_early,
    choose_fetch_wait,
)
from deferline.schemas import (
    CancelRequest,
    DeadLetter,
    KwargsCipher,
    ResumeTarget,
    RunTask,
    TriggerEventRecord,
    encode,
    make_event_id,
    seal,
)
from deferline.topics import Settings, TopicNames, ensure_topics, topic_specs

from tests._until import until
from tests.integration._triggerer_help import (
    TopicReader,
    defer_request,
    partition_of,
    produce,
    produce_requests,
)
from tests.integration._util import KafkaClients

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def options(tmp_path: Path, member: str = "solo", **changes: Any) -> TriggererOptions:
    fields: dict[str, Any] = {
        "member": member,
        "state_dir": tmp_path / member,
        "session_timeout_ms": 6000,
    }
    fields.update(changes)
    return TriggererOptions(**fields)


def running(triggerer: Triggerer, trigger_id: str) -> bool:
    return trigger_id in triggerer.supervisor


def records_read(triggerer: Triggerer, topic: str) -> float | None:
    """Records the member read while rebuilding its partitions (from its metrics)."""
    return triggerer.metrics.registry.get_sample_value(
        "deferline_triggerer_bootstrap_records_total", {"queue": "default", "topic": topic}
    )


def sample(triggerer: Triggerer, name: str, **labels: str) -> float | None:
    return triggerer.metrics.registry.get_sample_value(name, labels)


def bootstrapped(triggerer: Triggerer) -> bool:
    return all(lane.bootstrapped.is_set() and lane.owned for lane in triggerer.lanes)


async def test_each_trigger_fires_once_and_is_tombstoned(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    names = TopicNames(settings.topic_prefix)
    requests = [defer_request(i, due_in=0.3) for i in range(300)]
    async with Triggerer(settings, options(tmp_path)) as triggerer:
        producer = await kafka_clients.producer()
        await produce_requests(producer, settings, requests)
        async with (
            TopicReader(settings, names.resume()) as events,
            TopicReader(settings, names.defer()) as defer,
        ):
            await until(lambda: len(events.distinct_triggers()) == 300, within=30, interval=0.05)
            await until(lambda: len(defer.tombstones()) == 300, within=30, interval=0.05)
            await until(
                lambda: all(row[2] == 0 for lane in triggerer.lanes for row in lane.partitions()),
                within=10,
                interval=0.05,
                what="tables empty once tombstones are read back",
            )
    fired = events.events()
    assert len(fired) == 300, "exactly one event per trigger"
    for event in fired:
        assert event.status == "fired"
        assert event.member == "solo"
        assert event.partition == partition_of(event.trigger_id, settings.partitions)
        assert event.event_id == make_event_id(event.trigger_id, "fired", event.payload)
    assert defer.tombstones() == {r.trigger_id.encode() for r in requests}


async def test_cancel_request_stops_the_trigger_and_emits_cancelled(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    names = TopicNames(settings.topic_prefix)
    request = defer_request(1, due_in=3600)
    async with Triggerer(settings, options(tmp_path)) as triggerer:
        producer = await kafka_clients.producer()
        await produce_requests(producer, settings, [request])
        await until(lambda: running(triggerer, request.trigger_id), within=20, interval=0.05)
        cancel = CancelRequest(
            trigger_id=request.trigger_id, task=request.task, reason="task cleared"
        )
        await produce(producer, names.defer(), [(request.trigger_id.encode(), encode(cancel))])
        async with TopicReader(settings, names.resume()) as events:
            await until(lambda: events.events(), within=20, interval=0.05)
            await until(
                lambda: not running(triggerer, request.trigger_id), within=10, interval=0.05
            )
        async with TopicReader(settings, names.defer()) as defer:
            await until(
                lambda: request.trigger_id.encode() in defer.tombstones(), within=10, interval=0.05
            )
    [event] = events.events()
    assert event.status == "cancelled"
    assert event.trigger_id == request.trigger_id
    assert event.error == "task cleared"


@pytest.mark.brokers_differ("Kafka refuses keyless records on a compacted topic; Tansu takes them")
async def test_bad_input_is_dead_lettered_and_the_partition_keeps_moving(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path, broker_backend: str
) -> None:
    key = KwargsCipher.generate_key()
    settings = settings.model_copy(update={"kwargs_keys": [key]})
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    foreign = KwargsCipher([KwargsCipher.generate_key()])
    cases: dict[str, tuple[bytes | None, bytes]] = {}
    raw = defer_request(0, due_in=3600)
    cases["SchemaError"] = (raw.trigger_id.encode(), b"\x00 not json at all")
    r = defer_request(1, due_in=3600)
    cases["UnknownSchemaVersion"] = (
        r.trigger_id.encode(),
        orjson.dumps({**orjson.loads(encode(r)), "version": 99}),
    )
    r = defer_request(2, classpath="os.system", kwargs={})
    cases["TriggerNotAllowed"] = (r.trigger_id.encode(), encode(r))
    r = defer_request(3, classpath="deferline.engine.triggers.NoSuchTrigger", kwargs={})
    cases["TriggerImportError"] = (r.trigger_id.encode(), encode(r))
    r = defer_request(4, kwargs={"no_such_argument": 1})
    cases["TriggerKwargsError"] = (r.trigger_id.encode(), encode(r))
    r = seal(defer_request(5, due_in=3600), foreign)
    cases["DecryptionError"] = (r.trigger_id.encode(), encode(r))
    if broker_backend == "tansu":  # Kafka itself refuses keyless records on a compacted topic
        r = defer_request(6, due_in=3600)
        cases["MissingKey"] = (None, encode(r))
    good = seal(defer_request(7, due_in=0), KwargsCipher([key]))
    producer = await kafka_clients.producer()
    # Everything on one partition, the good request last: it must still fire.
    records = [*cases.values(), (good.trigger_id.encode(), encode(good))]
    await produce(producer, names.defer(), records, partition=0)
    async with (
        Triggerer(settings, options(tmp_path)),
        TopicReader(settings, names.resume()) as events,
        TopicReader(settings, names.dead) as dead,
        TopicReader(settings, names.defer()) as defer,
    ):
        await until(lambda: good.trigger_id in events.distinct_triggers(), within=30, interval=0.05)
        await until(lambda: len(dead.values()) >= len(cases), within=20, interval=0.05)
        keyed = {k for k, _ in cases.values() if k is not None}
        await until(lambda: keyed <= defer.tombstones(), within=20, interval=0.05)
        await until(lambda: len(events.events()) >= len(cases), within=20, interval=0.05)
    letters = [v for v in dead.values() if isinstance(v, DeadLetter)]
    assert sorted(letter.error_type for letter in letters) == sorted(cases)
    for letter in letters:
        k, value = cases[letter.error_type]
        assert (letter.key, letter.value) == (k, value), "the original bytes are kept"
        assert letter.topic == names.defer()
        assert letter.partition == 0
        assert letter.error
        assert letter.member == "solo"
    by_trigger = {event.trigger_id: event for event in events.events()}
    assert by_trigger[good.trigger_id].status == "fired"
    failed = [e for e in by_trigger.values() if e.status == "failed"]
    # Every case but the undecodable bytes names its task, so the task fails with a reason.
    assert len(failed) == len(cases) - 1
    for event in failed:
        assert event.error
        assert any(error_type in event.error for error_type in cases)
    assert raw.trigger_id not in by_trigger


@pytest.mark.brokers_differ(
    "Tansu ignores the scan's time lookup; only it can die between event and tombstone"
)
async def test_an_event_already_on_the_resume_topic_is_not_fired_again(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    """The owner died between event and tombstone: the next owner only writes the tombstone."""
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    emitted, waiting = defer_request(1, due_in=0), defer_request(2, due_in=3600)
    producer = await kafka_clients.producer()
    await produce_requests(producer, settings, [emitted, waiting])
    earlier = TriggerEventRecord(
        event_id=make_event_id(emitted.trigger_id, "fired", None),
        trigger_id=emitted.trigger_id,
        task=emitted.task,
        status="fired",
        member="dead-member",
        partition=partition_of(emitted.trigger_id, settings.partitions),
    )
    await produce(
        producer,
        names.resume(),
        [(emitted.trigger_id.encode(), encode(earlier))],
        partition=earlier.partition,
    )
    async with (
        Triggerer(settings, options(tmp_path)) as triggerer,
        TopicReader(settings, names.defer()) as defer,
        TopicReader(settings, names.resume()) as events,
    ):
        await until(lambda: bootstrapped(triggerer), within=20, interval=0.05)
        await until(
            lambda: emitted.trigger_id.encode() in defer.tombstones(), within=20, interval=0.05
        )
        assert running(triggerer, waiting.trigger_id)
        assert not running(triggerer, emitted.trigger_id)
        await until(lambda: events.events(), within=10, interval=0.05)
    assert [e.member for e in events.events()] == ["dead-member"], "no second event"


@pytest.mark.brokers_differ(
    "Tansu's ListOffsets answers short of the end; the end comes from a fetch's high watermark"
)
async def test_restart_of_a_member_reads_only_the_tail(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    first = [defer_request(i, due_in=3600) for i in range(400)]
    tail = [defer_request(i, due_in=3600, run="tail") for i in range(37)]
    producer = await kafka_clients.producer()
    async with Triggerer(settings, options(tmp_path)) as triggerer:
        await produce_requests(producer, settings, first)
        await until(lambda: triggerer.supervisor.running == 400, within=30, interval=0.05)
    # Stopped cleanly: checkpoints written. Records produced meanwhile form the tail.
    await produce_requests(producer, settings, tail)
    async with Triggerer(settings, options(tmp_path)) as triggerer:
        await until(lambda: bootstrapped(triggerer), within=30, interval=0.05)
        assert triggerer.supervisor.running == 437
        assert records_read(triggerer, "defer") == 37
        assert records_read(triggerer, "resume") == 0
    # Without the checkpoint, a member reads everything.
    async with Triggerer(settings, options(tmp_path, member="fresh")) as triggerer:
        await until(lambda: bootstrapped(triggerer), within=30, interval=0.05)
        assert triggerer.supervisor.running == 437
        assert records_read(triggerer, "defer") == 437


async def test_a_queue_runs_only_on_members_of_that_queue(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings, queues=["q1"]))
    on_q1 = [defer_request(i, due_in=0.5, queue="q1") for i in range(20)]
    on_default = [defer_request(i, due_in=0.5, run="d") for i in range(20)]
    async with (
        Triggerer(settings, options(tmp_path, member="q1-member", queues=("q1",))) as q1,
        Triggerer(settings, options(tmp_path, member="default-member")) as default,
        TopicReader(settings, names.resume("q1")) as q1_events,
        TopicReader(settings, names.resume()) as default_events,
    ):
        await until(lambda: bootstrapped(q1) and bootstrapped(default), within=30, interval=0.05)
        producer = await kafka_clients.producer()
        await produce_requests(producer, settings, [*on_q1, *on_default])
        await until(lambda: len(q1_events.distinct_triggers()) == 20, within=30, interval=0.05)
        await until(lambda: len(default_events.distinct_triggers()) == 20, within=30, interval=0.05)
    assert {e.member for e in q1_events.events()} == {"q1-member"}
    assert {e.queue for e in q1_events.events()} == {"q1"}
    assert q1_events.distinct_triggers() == {r.trigger_id for r in on_q1}
    assert {e.member for e in default_events.events()} == {"default-member"}


async def test_direct_resume_enqueues_the_run_task(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    names = TopicNames(settings.topic_prefix)
    target = ResumeTarget(operator="pkg.ops.Wait", worker_queue="default", pool="p", pool_slots=2)
    with_target = defer_request(1, due_in=0, resume=target)
    without = defer_request(2, due_in=0)
    async with (
        Triggerer(settings, options(tmp_path, direct_resume=True)),
        TopicReader(settings, names.resume()) as events,
        TopicReader(settings, names.resumes("default")) as resumes,
    ):
        producer = await kafka_clients.producer()
        await produce_requests(producer, settings, [with_target, without])
        await until(lambda: len(events.distinct_triggers()) == 2, within=30, interval=0.05)
        await until(lambda: resumes.values(), within=10, interval=0.05)
    by_trigger = {e.trigger_id: e for e in events.events()}
    assert by_trigger[with_target.trigger_id].resumed_directly
    assert not by_trigger[without.trigger_id].resumed_directly
    [run] = resumes.values()
    assert isinstance(run, RunTask)
    assert run.mode == "resume"
    assert run.task == with_target.task
    assert run.trigger_id == with_target.trigger_id
    assert run.event_id == by_trigger[with_target.trigger_id].event_id
    assert (run.operator, run.pool, run.pool_slots) == ("pkg.ops.Wait", "p", 2)
    assert run.next_method == with_target.next_method


async def test_backpressure_pauses_fetching_and_drops_nothing(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    names = TopicNames(settings.topic_prefix)
    # Coroutine triggers (not timers) that each wait a moment, ten at a time.
    requests = [
        defer_request(
            i,
            classpath="deferline.engine.triggers.FileTrigger",
            kwargs={"filepath": str(tmp_path / "flag"), "poll_interval": 0.05},
        )
        for i in range(120)
    ]
    opts = options(tmp_path, capacity=10, max_pending=20)
    async with (
        Triggerer(settings, opts) as triggerer,
        TopicReader(settings, names.resume()) as events,
    ):
        await until(lambda: bootstrapped(triggerer), within=30, interval=0.05)
        producer = await kafka_clients.producer()
        await produce_requests(producer, settings, requests)

        def paused() -> float | None:
            return sample(triggerer, "deferline_triggerer_fetch_paused", queue="default")

        await until(lambda: paused() == 1, within=20, interval=0.05, what="fetch paused")
        assert triggerer.supervisor.running == 10
        (tmp_path / "flag").write_text("go")
        await until(lambda: len(events.distinct_triggers()) == 120, within=60, interval=0.05)
        await until(lambda: paused() == 0, within=10, interval=0.05, what="fetch resumed")
    assert {e.status for e in events.events()} == {"fired"}


async def test_graceful_stop_hands_partitions_over(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    requests = [defer_request(i, due_in=3600) for i in range(100)]
    producer = await kafka_clients.producer()
    await ensure_topics(settings, topic_specs(settings))
    await produce_requests(producer, settings, requests)
    async with Triggerer(settings, options(tmp_path, member="a")) as a:
        b = Triggerer(settings, options(tmp_path, member="b"))
        await b.start()
        try:
            await until(
                lambda: (
                    bootstrapped(a)
                    and bootstrapped(b)
                    and len(a.lanes[0].owned) + len(b.lanes[0].owned) == settings.partitions
                ),
                within=30,
                interval=0.05,
            )
            assert a.supervisor.running + b.supervisor.running == 100
        finally:
            await b.stop()
        await until(lambda: len(a.lanes[0].owned) == settings.partitions, within=20, interval=0.05)
        await until(
            lambda: bootstrapped(a) and a.supervisor.running == 100, within=20, interval=0.05
        )


async def test_the_metrics_show_each_lanes_membership(settings: Settings, tmp_path: Path) -> None:
    """A member alone takes every partition over: its lane's figures, counted by the member
    core, are served under the triggerer's names, one series per queue."""
    async with Triggerer(settings, options(tmp_path)) as triggerer:
        [lane] = triggerer.lanes
        await until(
            lambda: bootstrapped(triggerer) and len(lane.owned) == settings.partitions,
            within=30,
            interval=0.05,
        )
        queue = {"queue": "default"}
        assert sample(triggerer, "deferline_triggerer_assigned_partitions", **queue) == (
            settings.partitions
        )
        assert (sample(triggerer, "deferline_triggerer_takeovers_total", **queue) or 0) >= (
            settings.partitions
        ), "every partition taken over (again, if a rebalance cut a rebuild short)"
        rebalances = sample(triggerer, "deferline_triggerer_rebalances_total", **queue)
        assert rebalances == len(lane.rebalance_log) >= 1, "each assignment counted once"
        assert sample(triggerer, "deferline_triggerer_partitions_fenced_total", **queue) == 0


@pytest.mark.brokers_differ("the fetch wait is chosen from the broker's own answers")
async def test_fetch_wait_is_a_long_poll_only_where_the_broker_answers_early(
    settings: Settings, broker_backend: str, tmp_path: Path
) -> None:
    tansu = broker_backend == "tansu"
    assert await answers_fetches_early(settings) is not tansu
    async with Triggerer(settings, options(tmp_path)) as triggerer:
        assert triggerer.fetch_max_wait_ms == (SHORT_WAIT_MS if tansu else LONG_POLL_MS)
    async with Triggerer(settings, options(tmp_path, fetch_max_wait_ms=7)) as triggerer:
        assert triggerer.fetch_max_wait_ms == 7  # an explicit wait is kept as given


async def test_an_unreachable_broker_gets_the_short_fetch_wait() -> None:
    unreachable = Settings(bootstrap_servers="127.0.0.1:1")
    assert await answers_fetches_early(unreachable, timeout_s=2.0) is False
    assert await choose_fetch_wait(unreachable, None) == SHORT_WAIT_MS
