"""The console's pure parts: loop figures, dead letters, group moves and its status."""

from __future__ import annotations

import datetime as dt
import socket

import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError
from click.testing import CliRunner
from deferline.replay import (
    GroupHints,
    GroupView,
    LiveView,
    MemberView,
    RawRecord,
    TopicInfo,
    TopicRole,
    TopicsNotFound,
)
from deferline.runners import IllegalTransition
from deferline.runners.cli import main
from deferline.runners.console.testing import (
    ConsoleState,
    ConsoleStatus,
    GroupTracker,
    LoopStats,
    RecordFeed,
    TopicTail,
    percentile,
)
from deferline.schemas import DeadLetter, TaskKey, encode
from deferline.topics import Settings

from tests.fakes import FakeConsumer, FakeKafka

T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
TASKS = TopicInfo("d.tasks", TopicRole.TASKS)
RESUME = TopicInfo("d.resume", TopicRole.RESUME)
DEAD = TopicInfo("d.dead", TopicRole.DEAD)
DEFER = TopicInfo("d.defer", TopicRole.DEFER)


def state(state: str, *, event_id: str | None = None) -> bytes:
    return orjson.dumps({"kind": "task_state", "state": state, "event_id": event_id})


def event(event_id: str, at: dt.datetime, status: str = "fired") -> bytes:
    return orjson.dumps(
        {
            "kind": "trigger_event",
            "event_id": event_id,
            "status": status,
            "trigger_id": "t-" + event_id,
            "task": {"dag_id": "d", "task_id": "t", "run_id": "r", "map_index": -1},
            "emitted_at": at.isoformat(),
            "error": "boom" if status == "failed" else None,
        }
    )


def ms(at: dt.datetime) -> int:
    return int(at.timestamp() * 1000)


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([], 0.5) is None


def test_counts_follow_the_latest_state_per_task_and_tombstones():
    loop = LoopStats()
    loop.task_state(b"a", state("scheduled"), None)
    loop.task_state(b"a", state("deferred"), None)
    loop.task_state(b"b", state("deferred"), None)
    loop.task_state(b"c", state("success"), None)
    loop.task_state(b"c", None, None)  # tombstone
    summary = loop.sample(T0.timestamp())
    assert summary.tasks == {"deferred": 2}
    assert summary.deferrals_waiting == 2
    assert len(loop) == 2


def test_rates_are_per_second_over_the_last_ten_seconds():
    loop = LoopStats()
    now = T0.timestamp()
    loop.sample(now)
    for i in range(20):
        loop.task_state(f"k{i}".encode(), state("success"), None)
        loop.trigger_event(event(f"e{i}", T0))
    summary = loop.sample(now + 4)
    assert summary.change_per_s == {"success": 5.0}
    assert summary.events_per_s == 5.0


def test_resume_latency_pairs_event_and_state_in_either_order():
    loop = LoopStats()
    # event first, then the scheduler's state 0.2 s later (broker timestamp)
    loop.trigger_event(event("e1", T0))
    loop.task_state(b"a", state("queued", event_id="e1"), ms(T0 + dt.timedelta(seconds=0.2)))
    # state first (another partition read earlier), then its event
    loop.task_state(b"b", state("queued", event_id="e2"), ms(T0 + dt.timedelta(seconds=1.5)))
    loop.trigger_event(event("e2", T0 + dt.timedelta(seconds=0.5)))
    summary = loop.sample((T0 + dt.timedelta(seconds=2)).timestamp())
    assert summary.resumes_in_window == 2
    assert summary.resume_p50_s == pytest.approx(0.2)
    assert summary.resume_p99_s == pytest.approx(1.0)
    later = loop.sample((T0 + dt.timedelta(seconds=120)).timestamp())
    assert later.resumes_in_window == 0
    assert later.resume_p50_s is None


def raw(topic: TopicInfo, offset: int, value: bytes | None, key: bytes | None = None) -> RawRecord:
    return RawRecord(topic, 0, offset, ms(T0), key, value)


def test_feed_keeps_dead_letters_and_failures_newest_first():
    feed = RecordFeed()
    task = TaskKey(dag_id="d", task_id="t", run_id="r")
    for n in range(3):
        letter = DeadLetter(
            topic="d.defer",
            partition=0,
            offset=n,
            value=b'{"classpath": "os.system"}',
            error=f"refused {n}",
            error_type="TriggerNotAllowed",
            trigger_id=f"t{n}",
            task=task,
        )
        feed.feed(raw(DEAD, n, encode(letter)))
    feed.feed(raw(DEAD, 3, b"not json"))
    feed.feed(raw(RESUME, 0, event("e1", T0, status="failed")))
    feed.feed(raw(RESUME, 1, event("e2", T0)))
    feed.feed(raw(DEFER, 0, b"{}"))
    assert [d["error"] for d in feed.dead] == [None, "refused 2", "refused 1", "refused 0"]
    assert feed.dead[0]["error_type"] == "undecodable"
    assert feed.dead[1]["value"] == '{"classpath": "os.system"}'
    assert feed.dead[1]["ti_key"] == "d/t/r/-1"
    assert feed.dead[1]["source"] == "d.defer[0]@2"
    assert [f["trigger_id"] for f in feed.failed] == ["t-e1"]
    assert feed.loop.events_seen == 2
    assert feed.records == 7


def live(owners: dict[str, list[int]]) -> LiveView:
    members = tuple(
        MemberView(f"{n}-id", n, "/127.0.0.1", ("d.defer",), tuple(("d.defer", p) for p in ps))
        for n, ps in owners.items()
    )
    group = GroupView("d.triggerer", "Stable", members, {("d.defer", p): 5 for p in range(4)})
    return LiveView(
        taken_at=T0,
        groups=(group,),
        topics=(DEFER,),
        end_offsets={("d.defer", p): 7 for p in range(4)},
        hints=GroupHints.for_prefix("d."),
    )


def test_a_partition_that_changes_owner_is_a_move_with_its_pause():
    tracker = GroupTracker()
    start = T0.timestamp()
    tracker.observe(live({"a": [0, 1], "b": [2, 3]}), start)
    tracker.observe(live({"b": [2, 3]}), start + 2)  # a died: 0 and 1 have no owner
    view = tracker.observe(live({"b": [0, 1, 2, 3]}), start + 9)[0]
    assert view["role"] == "triggerer"
    assert [(m["partition"], m["from"], m["to"], m["paused_s"]) for m in view["moves"]] == [
        (1, "a", "b", 9.0),
        (0, "a", "b", 9.0),
    ]
    assert [m["member"] for m in view["left"]] == ["a"]
    assert view["members"][0]["partitions"] == [f"d.defer[{p}]" for p in range(4)]
    assert {p["lag"] for p in view["partitions"]} == {2}
    assert {p["owner"] for p in view["partitions"]} == {"b"}


def test_a_partition_handed_over_between_two_looks_paused_at_most_one_interval():
    tracker = GroupTracker()
    tracker.observe(live({"a": [0, 1], "b": [2, 3]}), 100.0)
    view = tracker.observe(live({"a": [0], "b": [1, 2, 3]}), 102.0)[0]
    assert [(m["partition"], m["from"], m["to"], m["paused_s"]) for m in view["moves"]] == [
        (1, "a", "b", 2.0)
    ]
    assert view["left"] == []


def test_the_scheduler_group_shows_its_lag_on_tasks_events():
    events = TopicInfo("d.tasks.events", TopicRole.TASK_EVENTS)
    member = MemberView("s-id", "sched", "/127.0.0.1", ("d.tasks.events",), ())
    group = GroupView("d.scheduler", "Stable", (member,), {("d.tasks.events", 0): 3})
    view = GroupTracker().observe(
        LiveView(
            taken_at=T0,
            groups=(group,),
            topics=(events,),
            end_offsets={("d.tasks.events", 0): 5},
            hints=GroupHints.for_prefix("d."),
        ),
        T0.timestamp(),
    )
    assert [(v["group"], v["role"]) for v in view] == [("d.scheduler", "scheduler")]
    assert [(p["topic"], p["lag"]) for p in view[0]["partitions"]] == [("d.tasks.events", 2)]


SETTINGS = Settings(bootstrap_servers="broker:9092", topic_prefix="d.")


def test_status_moves_only_along_its_transitions():
    status = ConsoleStatus(SETTINGS)
    with pytest.raises(IllegalTransition, match="console status cannot go from connecting to live"):
        status.move(ConsoleState.LIVE, "live")
    status.move(ConsoleState.CATCHING_UP, "reading")
    status.move(ConsoleState.LIVE, "live")
    assert status.ok
    status.fail(KafkaConnectionError("Unable to bootstrap"))
    assert status.to_json()["state"] == "unreachable"
    assert status.to_json()["ok"] is False
    status.move(ConsoleState.CONNECTING, "again")
    assert status.to_json()["state"] == "connecting"


@pytest.mark.parametrize(
    ("error", "state", "words"),
    [
        (TopicsNotFound("none"), ConsoleState.EMPTY, "no deferline topics under the prefix 'd.'"),
        (
            TopicAuthorizationFailedError("d.tasks"),
            ConsoleState.REFUSED,
            "refused this console: AuthorizationError",
        ),
        (KafkaConnectionError("Unable to bootstrap"), ConsoleState.UNREACHABLE, "broker:9092"),
        (ValueError("odd"), ConsoleState.FAILED, "ValueError: odd"),
    ],
)
def test_each_failure_is_named_for_the_page(error: Exception, state: ConsoleState, words: str):
    found, message = ConsoleStatus(SETTINGS).explain(error)
    assert found is state
    assert words in message


async def test_a_topic_listed_later_is_read_from_its_start_and_the_others_keep_their_place():
    tail = TopicTail(SETTINGS, RecordFeed(), ConsoleStatus(SETTINGS))
    kafka = FakeKafka()
    kafka.create_topic("d.tasks", 2)
    kafka.create_topic("d.dead", 1)
    for topic, partition in (("d.tasks", 0), ("d.tasks", 1), ("d.dead", 0)):
        kafka.append(topic, None, b"written before", partition=partition)
    # Reset to the end, should a position be forgotten rather than kept or sought.
    consumer = FakeConsumer(kafka, auto_offset_reset="latest")

    async def positions() -> dict[TopicPartition, int]:
        return {tp: await consumer.position(tp) for tp in consumer.assignment()}

    tail.topics = {"d.tasks": (TASKS, 2)}
    await tail._assign(consumer)
    assert await positions() == {TopicPartition("d.tasks", 0): 0, TopicPartition("d.tasks", 1): 0}
    consumer.seek(TopicPartition("d.tasks", 0), 500)
    await tail._assign(consumer)  # nothing new: nothing moves
    assert await consumer.position(TopicPartition("d.tasks", 0)) == 500
    tail.topics["d.dead"] = (DEAD, 1)
    await tail._assign(consumer)
    assert await positions() == {
        TopicPartition("d.tasks", 0): 500,
        TopicPartition("d.tasks", 1): 0,
        TopicPartition("d.dead", 0): 0,
    }


def test_the_command_is_listed_and_a_taken_port_is_a_clear_error():
    listed = CliRunner().invoke(main, ["--help"])
    assert "console" in listed.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = CliRunner().invoke(
            main, ["console", "--port", port, "--bootstrap-servers", "127.0.0.1:1"]
        )
    assert result.exit_code == 1
    assert f"cannot serve the console on 127.0.0.1:{port}" in result.output
