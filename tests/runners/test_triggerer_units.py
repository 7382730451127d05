"""Triggerer pieces without a broker: record interpretation, the emitter, metrics, logs."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from typing import Any

import aiohttp
import orjson
import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError
from deferline.engine.triggers import DateTimeTrigger
from deferline.runners.member import MemberFigures
from deferline.runners.testing import JsonFormatter, MetricsServer, TextFormatter
from deferline.runners.triggerer import TriggererOptions
from deferline.runners.triggerer.testing import (
    BadRecord,
    CancelTrigger,
    Emission,
    Emitter,
    Send,
    StartTrigger,
    TriggererMetrics,
    interpret,
    normalise_queues,
    restart_delay,
)
from deferline.schemas import (
    CancelRequest,
    DeferRequest,
    KwargsCipher,
    TaskKey,
    encode,
    make_trigger_id,
    seal,
)
from prometheus_client import CollectorRegistry, Counter

from tests import fakes
from tests._until import until
from tests.fakes import FakeKafka

from .test_triggerer_release import FiringEmitter, make_lane

ALLOWED = ("deferline.engine.triggers",)
TASK = TaskKey(dag_id="d", task_id="t", run_id="r")
TID = make_trigger_id(TASK, 0)
MOMENT = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def request(**changes: Any) -> DeferRequest:
    fields: dict[str, Any] = {
        "trigger_id": TID,
        "task": TASK,
        "classpath": "deferline.engine.triggers.DateTimeTrigger",
        "kwargs": {"moment": MOMENT},
    }
    fields.update(changes)
    return DeferRequest(**fields)


def decide(key: bytes | None, value: bytes, cipher: KwargsCipher | None = None) -> Any:
    return interpret(key, value, allowed_prefixes=ALLOWED, cipher=cipher)


# -- interpretation -------------------------------------------------------------------------


def test_a_valid_request_becomes_a_trigger() -> None:
    decision = decide(TID.encode(), encode(request()))
    assert isinstance(decision, StartTrigger)
    assert isinstance(decision.trigger, DateTimeTrigger)
    assert decision.trigger.trigger_id == TID
    assert decision.trigger.task_instance == TASK, "the task's key, as Airflow's triggerer sets"
    assert decision.request.task == TASK


def test_sealed_kwargs_are_opened_with_the_configured_keys() -> None:
    cipher = KwargsCipher([KwargsCipher.generate_key()])
    sealed = seal(request(), cipher)
    assert sealed.kwargs_token is not None
    decision = decide(TID.encode(), encode(sealed), cipher)
    assert isinstance(decision, StartTrigger)


def test_a_cancel_request_is_a_cancel() -> None:
    cancel = CancelRequest(trigger_id=TID, task=TASK, reason="cleared")
    decision = decide(TID.encode(), encode(cancel))
    assert isinstance(decision, CancelTrigger)
    assert decision.request.reason == "cleared"


@pytest.mark.parametrize(
    ("key", "value", "error_type", "identified"),
    [
        (None, encode(request()), "MissingKey", True),
        (b"\xff\xfe", encode(request()), "BadKey", True),
        (TID.encode(), b"\x00not json", "SchemaError", False),
        (TID.encode(), b"[1, 2]", "SchemaError", False),
        (
            TID.encode(),
            orjson.dumps({**orjson.loads(encode(request())), "version": 99}),
            "UnknownSchemaVersion",
            True,
        ),
        (TID.encode(), encode(request(classpath="os.system")), "TriggerNotAllowed", True),
        (
            TID.encode(),
            encode(request(classpath="deferline.engine.triggers.NoSuchTrigger")),
            "TriggerImportError",
            True,
        ),
        (TID.encode(), encode(request(kwargs={"bogus": 1})), "TriggerKwargsError", True),
        (b"other-id", encode(request()), "KeyMismatch", True),
    ],
    ids=[
        "no-key",
        "non-utf8-key",
        "not-json",
        "not-an-object",
        "unknown-version",
        "not-allowed",
        "import-error",
        "bad-kwargs",
        "key-mismatch",
    ],
)
def test_bad_input_is_named_and_identified_where_possible(
    key: bytes | None, value: bytes, error_type: str, identified: bool
) -> None:
    decision = decide(key, value)
    assert isinstance(decision, BadRecord)
    assert decision.error_type == error_type
    assert decision.error
    assert decision.identified is identified
    if identified:
        assert decision.task == TASK


def test_undecryptable_kwargs_are_bad_input_that_names_the_task() -> None:
    sealed = seal(request(), KwargsCipher([KwargsCipher.generate_key()]))
    other = KwargsCipher([KwargsCipher.generate_key()])
    decision = decide(TID.encode(), encode(sealed), other)
    assert isinstance(decision, BadRecord)
    assert decision.error_type == "DecryptionError"
    assert decision.identified


def test_a_token_without_configured_keys_is_bad_input() -> None:
    sealed = seal(request(), KwargsCipher([KwargsCipher.generate_key()]))
    decision = decide(TID.encode(), encode(sealed), None)
    assert isinstance(decision, BadRecord)
    assert decision.identified


def test_a_record_of_another_kind_is_bad_input() -> None:
    from deferline.schemas import TriggerEventRecord

    event = TriggerEventRecord(event_id="e", trigger_id=TID, task=TASK, status="fired")
    decision = decide(TID.encode(), encode(event))
    assert isinstance(decision, BadRecord)
    assert decision.error_type == "WrongKind"


# -- emitter ----------------------------------------------------------------------------------


def producer_of(**options: Any) -> fakes.FakeProducer:
    """A producer over a broker of its own, whose topics have 8 partitions."""
    return fakes.FakeProducer(FakeKafka(partitions=8), **options)


async def test_tombstone_follows_the_acked_event() -> None:
    producer = producer_of()
    acked: list[int] = []
    done = asyncio.Event()
    async with Emitter(producer) as emitter:
        emitter.submit(
            Emission(
                sends=[Send("resume", b"k", b"event", 3)],
                tombstone=Send("defer", b"k", None, 3),
                on_acked=lambda meta: acked.append(meta[0].offset),
                on_done=done.set,
            )
        )
        assert await emitter.flush(5)
    assert done.is_set()
    assert acked == [0]
    assert [(r.topic, r.value, r.partition) for r in producer.kafka.records()] == [
        ("resume", b"event", 3),
        ("defer", None, 3),
    ]


async def test_many_emissions_are_sent_in_batches_and_all_finish() -> None:
    producer = producer_of()
    async with Emitter(producer, max_batch=100) as emitter:
        for i in range(1000):
            key = str(i).encode()
            emitter.submit(
                Emission(sends=[Send("resume", key, b"e")], tombstone=Send("defer", key, None))
            )
        assert await emitter.flush(5)
        assert emitter.backlog == 0
    written = [(r.topic, r.key, r.value) for r in producer.kafka.records()]
    resume = [key for topic, key, _ in written if topic == "resume"]
    defer = [key for topic, key, _ in written if topic == "defer"]
    assert len(resume) == len(defer) == 1000
    for tomb_key in defer:  # every tombstone was sent after its event
        assert written.index(("resume", tomb_key, b"e")) < written.index(("defer", tomb_key, None))


async def test_a_retriable_failure_is_retried_and_no_tombstone_goes_first() -> None:
    producer = producer_of()
    producer.fail_sends["resume"] = [KafkaTimeoutError(), KafkaTimeoutError()]
    async with Emitter(producer, retry_backoff=0.01) as emitter:
        emitter.submit(
            Emission(sends=[Send("resume", b"k", b"e")], tombstone=Send("defer", b"k", None))
        )
        assert await emitter.flush(5)
        assert emitter.failures == 2
    assert [r.topic for r in producer.kafka.records()] == ["resume", "defer"]


async def test_batched_records_get_their_own_offsets() -> None:
    producer = producer_of(max_batch_records=50)
    offsets: list[int] = []
    async with Emitter(producer) as emitter:
        for i in range(120):  # three producer batches on one partition
            emitter.submit(
                Emission(
                    sends=[Send("resume", str(i).encode(), b"e", 0)],
                    on_acked=lambda meta: offsets.append(meta[0].offset),
                )
            )
        assert await emitter.flush(5)
    assert sorted(offsets) == list(range(120))
    assert len(producer.batches) == 3
    assert [r.key for r in producer.kafka.records()] == [str(i).encode() for i in range(120)]


async def test_a_permanent_failure_is_handed_back_without_a_tombstone() -> None:
    producer = producer_of(max_request_size=10_000)
    failed: list[BaseException] = []
    async with Emitter(producer, retry_backoff=0.01, give_up_after=3) as emitter:
        emitter.submit(
            Emission(
                sends=[Send("resume", b"k", b"x" * 20_000, 1)],
                tombstone=Send("defer", b"k", None),
                on_failed=failed.append,
            )
        )
        assert await emitter.flush(5)
    assert len(failed) == 1
    assert isinstance(failed[0], MessageSizeTooLargeError)
    assert producer.kafka.records() == []


async def test_flush_times_out_while_sends_cannot_complete() -> None:
    producer = producer_of()
    producer.fail_sends["resume"] = [KafkaTimeoutError()] * 1000
    emitter = Emitter(producer, retry_backoff=0.01)
    await emitter.start()
    emitter.submit(
        Emission(sends=[Send("resume", b"k", b"e")], tombstone=Send("defer", b"k", None))
    )
    assert not await emitter.flush(0.2)
    producer.fail_sends.clear()
    assert await emitter.flush(5)
    await emitter.stop()


# -- metrics ----------------------------------------------------------------------------------


async def test_metrics_server_serves_its_own_registry() -> None:
    registry = CollectorRegistry()
    Counter("deferline_test_things", "Things.", registry=registry).inc(3)
    async with MetricsServer(registry, host="127.0.0.1", port=0) as server:
        assert server.port
        url = f"http://127.0.0.1:{server.port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200
            body = await response.text()
    assert "deferline_test_things_total 3.0" in body


async def test_metrics_server_serves_only_the_series_asked_for() -> None:
    registry = CollectorRegistry()
    Counter("deferline_test_things", "Things.", registry=registry).inc(3)
    Counter("deferline_test_others", "Others.", registry=registry).inc(5)
    async with MetricsServer(registry, host="127.0.0.1", port=0) as server:
        url = f"http://127.0.0.1:{server.port}/metrics?name[]=deferline_test_others_total"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            body = await response.text()
    assert "deferline_test_others_total 5.0" in body
    assert "deferline_test_things" not in body


def test_triggerer_metrics_read_live_sources_at_scrape_time() -> None:
    from deferline.engine import LagHistogram
    from prometheus_client import generate_latest

    metrics = TriggererMetrics(member="m1")
    state = {"running": 5.0, "capacity_left": 995.0, "fired": 7.0, "blocked_loop": 1.0}
    lag = LagHistogram()
    lag.observe(0.003)
    metrics.watch(
        supervisor=lambda: state,
        fire_lag=lambda: lag,
        partitions=lambda: [("default", 0, 10, 2), ("default", 1, 4, 0)],
        backlog=lambda: 3,
    )
    lane = MemberFigures()  # the default queue's lane, as a member: its rounds
    metrics.members.add(lane, "default")
    for _ in range(12):
        lane.round_committed()
    metrics.events.labels(queue="default", status="fired").inc(7)
    text = generate_latest(metrics.registry).decode()
    for line in (
        "deferline_triggers_running 5.0",
        "deferline_triggerer_capacity_left 995.0",
        "deferline_triggers_succeeded_total 7.0",
        "deferline_triggers_blocked_main_thread_total 1.0",
        'deferline_triggerer_consumer_lag{partition="0",queue="default"} 2.0',
        'deferline_triggerer_active_triggers{partition="1",queue="default"} 4.0',
        "deferline_triggerer_emitter_backlog 3.0",
        "deferline_triggerer_transactions_total 12.0",
        'deferline_triggerer_events_total{queue="default",status="fired"} 7.0',
        'deferline_triggerer_info{member="m1"} 1.0',
        "deferline_trigger_fire_lag_seconds_count 1.0",
    ):
        assert line in text, line
    state["running"] = 6.0
    assert "deferline_triggers_running 6.0" in generate_latest(metrics.registry).decode()
    # Asked for by name (a scrape with ?name[]=...), the live series are there too.
    names = ["deferline_triggers_running", "deferline_triggerer_consumer_lag"]
    some = generate_latest(metrics.registry.restricted_registry(names)).decode()
    assert "deferline_triggers_running 6.0" in some
    assert 'deferline_triggerer_consumer_lag{partition="0",queue="default"} 2.0' in some
    assert "deferline_triggerer_emitter_backlog" not in some


def test_the_membership_metrics_keep_their_names_types_and_labels() -> None:
    """Read from the member core's figures of each lane, under the names the triggerer
    always had (and the two a scheduler had too: takeovers, fenced transactions)."""
    from prometheus_client import generate_latest

    metrics = TriggererMetrics()
    metrics.members.add(MemberFigures(), "default")
    kinds = {metric.name: metric.type for metric in metrics.registry.collect()}
    names = {
        "rebalances": "counter",
        "takeovers": "counter",
        "partitions_fenced": "counter",
        "assigned_partitions": "gauge",
        "transactions": "counter",
        "transactions_fenced": "counter",
    }
    assert {name: kinds.get(f"deferline_triggerer_{name}") for name in names} == names
    text = generate_latest(metrics.registry).decode()
    for line in (
        'deferline_triggerer_rebalances_total{queue="default"} 0.0',
        'deferline_triggerer_assigned_partitions{queue="default"} 0.0',
        "deferline_triggerer_transactions_total 0.0",  # the process's, every queue's
    ):
        assert line in text, line


async def test_a_lane_fenced_by_the_group_counts_its_partitions_and_owns_none() -> None:
    """The group refused a round of the lane's member producer: its partitions are dropped
    without emitting, counted as fenced, and no longer shown as assigned."""
    from prometheus_client import generate_latest

    lane, _ = make_lane(FiringEmitter())
    metrics = TriggererMetrics()
    metrics.members.add(lane.figures, lane.label)  # as the triggerer adds each lane's
    text = generate_latest(metrics.registry).decode()
    assert 'deferline_triggerer_assigned_partitions{queue="default"} 1.0' in text
    assert 'deferline_triggerer_partitions_fenced_total{queue="default"} 0.0' in text
    lane._fenced()
    await lane._await_losing()
    assert lane.owned == []
    text = generate_latest(metrics.registry).decode()
    assert 'deferline_triggerer_assigned_partitions{queue="default"} 0.0' in text
    assert 'deferline_triggerer_partitions_fenced_total{queue="default"} 1.0' in text


# -- logs and options --------------------------------------------------------------------------


def _record(**extra: Any) -> logging.LogRecord:
    record = logging.LogRecord(
        "deferline.x", logging.INFO, __file__, 1, "trigger fired", None, None
    )
    record.__dict__.update(extra)
    return record


def test_log_lines_carry_the_structured_fields() -> None:
    fields = {"trigger_id": "t-1", "task": "d/t/r/-1#1", "partition": 3, "member": "h-1"}
    text = TextFormatter().format(_record(**fields))
    assert "trigger fired" in text
    for key, value in fields.items():
        assert f"{key}={value}" in text
    doc = json.loads(JsonFormatter().format(_record(**fields)))
    assert doc["message"] == "trigger fired"
    assert {key: doc[key] for key in fields} == fields


def test_queue_names_are_normalised() -> None:
    assert normalise_queues(()) == (None,)
    assert normalise_queues(("default", "q1", "q1")) == (None, "q1")
    with pytest.raises(ValueError, match="invalid"):
        normalise_queues(("bad queue",))
    assert TriggererOptions().capacity == 10_000


# -- the hot-path event encoder ----------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [None, {"moment": MOMENT, "n": 1, "d": dt.timedelta(seconds=3)}, [1, "x", {"set": {1, 2}}]],
)
def test_fast_event_encoding_matches_the_record(payload: Any) -> None:
    from deferline.runners.triggerer.testing import encode_event, request_fields
    from deferline.schemas import TriggerEventRecord, decode, make_event_id

    stored = encode(request(defer_seq=3))
    emitted = dt.datetime(2030, 1, 1, 0, 0, 1, 250, tzinfo=dt.UTC)
    due = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    fields: dict[str, Any] = {
        "event_id": make_event_id(TID, "fired", payload),
        "trigger_id": TID,
        "status": "fired",
        "payload": payload,
        "task_outcome": "success",
        "xcoms": {"out": MOMENT},
        "error": None,
        "traceback": None,
        "due_at": due,
        "emitted_at": emitted,
        "member": "m-1",
        "partition": 5,
        "queue": "q1",
        "resumed_directly": True,
    }
    fast = decode(encode_event(request_fields(stored), **fields))
    slow = TriggerEventRecord(task=TASK, defer_seq=3, **fields)
    assert fast == decode(encode(slow))


async def test_the_emitter_reports_pressure_at_its_bound_and_relief_at_half() -> None:
    producer = producer_of()
    changes: list[tuple[bool, int]] = []
    emitter = Emitter(producer, max_backlog=10, on_pressure=lambda full: changes.append((full, 0)))
    for i in range(9):
        emitter.submit(Emission(sends=[Send("resume", str(i).encode(), b"e")]))
    assert changes == []  # not full below the bound
    emitter.submit(Emission(sends=[Send("resume", b"9", b"e")]))
    full_at_bound = emitter.full
    assert full_at_bound
    assert changes == [(True, 0)]
    await emitter.start()
    try:
        assert await emitter.flush(5)
    finally:
        await emitter.stop()
    assert changes == [(True, 0), (False, 0)]
    assert not emitter.full
    assert emitter.peak_backlog == 10
    assert len(producer.kafka.records()) == 10


def test_the_emitter_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_backlog"):
        Emitter(producer_of(), max_backlog=0)


async def test_a_full_emitter_holds_the_supervisor_timers_and_loses_nothing() -> None:
    from deferline.engine import TriggerSupervisor

    producer = producer_of()
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    supervisor: TriggerSupervisor
    emitter: Emitter

    def on_event(outcome: Any) -> None:
        key = outcome.trigger_id.encode()
        emitter.submit(Emission(sends=[Send("resume", key, b"e", 0)]))

    async with TriggerSupervisor(capacity=10_000, on_event=on_event, block_threshold=None) as sup:
        supervisor = sup
        emitter = Emitter(producer, max_batch=50, max_backlog=200, on_pressure=sup.hold_timers)
        async with emitter:
            for i in range(5000):
                supervisor.add(f"t{i:05}", DateTimeTrigger(past))
            await until(
                lambda: len(producer.kafka.records()) >= 5000,
                within=30,
                what="all 5000 events sent",
            )
            assert await emitter.flush(5)
    assert emitter.peak_backlog <= 201  # the event that fills it, and not one more
    assert [r.key for r in producer.kafka.records()] == [f"t{i:05}".encode() for i in range(5000)]


def test_the_burst_encoder_gives_the_bytes_of_encode_event_for_each_event() -> None:
    from deferline.runners.triggerer.testing import EventEncoder, encode_event, request_fields
    from deferline.schemas import TriggerEventRecord, decode

    fields = request_fields(encode(request(defer_seq=2)))
    encoder = EventEncoder()
    utc = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    plus2 = utc.astimezone(dt.timezone(dt.timedelta(hours=2)))  # same instant, other text
    cases: list[tuple[Any, dt.datetime | None]] = [
        (utc, utc),
        (utc, utc),  # memoised
        (plus2, plus2),  # equal to the last, but encoded differently
        (utc + dt.timedelta(seconds=1), None),
        ({"moment": MOMENT}, utc),
        (None, utc),
    ]
    for payload, due in cases:
        common: dict[str, Any] = {
            "event_id": "e",
            "trigger_id": TID,
            "status": "fired",
            "payload": payload,
            "task_outcome": None,
            "xcoms": None,
            "error": None,
            "traceback": None,
            "due_at": due,
            "member": "m",
            "partition": 1,
            "queue": None,
            "resumed_directly": False,
        }
        before = dt.datetime.now(dt.UTC)
        fast = encoder.encode(fields, **common)
        record = decode(fast)
        assert isinstance(record, TriggerEventRecord)
        assert record.emitted_at is not None
        assert before <= record.emitted_at <= dt.datetime.now(dt.UTC)
        expected = encode_event(fields, emitted_at=record.emitted_at, **common)
        assert orjson.loads(fast) | {"emitted_at": None} == orjson.loads(expected) | {
            "emitted_at": None
        }


def test_a_watch_starts_again_a_second_after_a_run_ends_and_backs_off_after_failures() -> None:
    assert [restart_delay(n) for n in range(9)] == [1, 1, 2, 4, 8, 16, 32, 60, 60]
