"""Standing watches in a triggerer on a real broker: many events per trigger, each published
once under its own id, the watch started again after a run ends or fails, stopped by its
tombstone, and taken over by another member when its owner is killed."""

from __future__ import annotations

import asyncio
import os
from functools import partial
from pathlib import Path

import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic
from deferline.runners.triggerer import Triggerer, TriggererOptions
from deferline.schemas import DeadLetter, WatchEvent, WatchRequest, encode, make_watch_event_id
from deferline.topics import Settings, TopicNames, ensure_topics, topic_specs

from tests._until import until
from tests.integration._triggerer_help import (
    FAILOVER_FLAGS,
    TopicReader,
    TriggererProcess,
    produce,
)
from tests.integration._util import KafkaClients
from tests.integration._watch_ops import INBOX, MODULE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def watch_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"allowed_trigger_prefixes": ["deferline.engine.triggers", MODULE]}
    )


def inbox_watch(trigger_id: str, inbox: Path, *, once: bool = False) -> WatchRequest:
    return WatchRequest(
        trigger_id=trigger_id, classpath=INBOX, kwargs={"directory": str(inbox)}, once=once
    )


def watch_events(reader: TopicReader) -> list[WatchEvent]:
    return [v for v in reader.values() if isinstance(v, WatchEvent)]


def drop(inbox: Path, *names: str) -> None:
    for name in names:
        (inbox / f".{name}").write_text(name)
        (inbox / f".{name}").rename(inbox / name)  # appears whole


async def publish(kafka_clients: KafkaClients, settings: Settings, watch: WatchRequest) -> None:
    producer = await kafka_clients.producer()
    topic = TopicNames(settings.topic_prefix).defer()
    await produce(producer, topic, [(watch.trigger_id.encode(), encode(watch))])


@pytest.mark.brokers_differ(
    "a watch's events go out in its partition's transactions on Apache Kafka, as plain "
    "sends on Tansu"
)
async def test_a_watch_publishes_every_event_and_runs_again_after_it_ends_or_fails(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    settings = watch_settings(settings)
    names = TopicNames(settings.topic_prefix)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    watch = inbox_watch("watch-1", inbox)
    options = TriggererOptions(member="solo", state_dir=tmp_path / "state", session_timeout_ms=6000)
    async with (
        Triggerer(settings, options) as triggerer,
        TopicReader(settings, names.resume()) as resume,
        TopicReader(settings, names.defer()) as defer,
    ):
        await publish(kafka_clients, settings, watch)
        drop(inbox, "a1", "a2", "a3")
        await until(lambda: len(watch_events(resume)) >= 3, within=30, what="three events")
        drop(inbox, "end-a4")
        await until(lambda: len(watch_events(resume)) >= 4, within=30, what="the run's last")
        drop(inbox, "b1")  # taken by the next run, started after the first ended
        await until(lambda: len(watch_events(resume)) >= 5, within=30, what="a second run")
        drop(inbox, "fail-b2")
        await until(
            lambda: any(e.status == "failed" for e in watch_events(resume)),
            within=30,
            what="the failed run's event",
        )
        drop(inbox, "c1")  # the third run, after a backoff of 1 s
        await until(lambda: len(watch_events(resume)) >= 7, within=30, what="a third run")

        events = watch_events(resume)
        assert [e.payload["name"] for e in events if e.status == "fired"] == [
            "a1",
            "a2",
            "a3",
            "end-a4",
            "b1",
            "c1",
        ]
        runs = list(dict.fromkeys(e.run for e in events))
        assert len(runs) == 3, "a run per start: after the end, after the failure"
        for event in events:
            assert event.trigger_id == "watch-1"
            assert event.member == "solo"
            assert event.event_id == make_watch_event_id("watch-1", event.run, event.seq)
        assert [e.seq for e in events if e.run == runs[0]] == [1, 2, 3, 4]
        assert [(e.seq, e.status) for e in events if e.run == runs[1]] == [
            (1, "fired"),
            (2, "failed"),
        ]
        failed = next(e for e in events if e.status == "failed")
        assert "inbox refused fail-b2" in (failed.error or "")
        assert len({e.event_id for e in events}) == len(events)
        assert b"watch-1" not in defer.tombstones(), "a watch's events tombstone nothing"
        assert "watch-1" in triggerer.supervisor
        assert triggerer.lanes[0].watching == 1

        # Its tombstone stops it for good: no run starts again.
        producer = await kafka_clients.producer()
        await produce(producer, names.defer(), [(b"watch-1", None)])
        await until(lambda: "watch-1" not in triggerer.supervisor, within=30, what="stopped")
        drop(inbox, "d1")
        await asyncio.sleep(0)  # nothing runs to take it (no wait could show more)
        assert (inbox / "d1").exists()
        assert triggerer.lanes[0].watching == 0


@pytest.mark.brokers_differ(
    "a watch's last event and its tombstone (and a dead letter) commit together on Apache "
    "Kafka, go out in order on Tansu"
)
async def test_a_watch_run_once_ends_with_its_run_and_a_watch_that_cannot_run_says_so(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    settings = watch_settings(settings)
    names = TopicNames(settings.topic_prefix)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    refused = WatchRequest(trigger_id="refused-1", classpath="not.allowed.Watch")
    options = TriggererOptions(member="solo", state_dir=tmp_path / "state", session_timeout_ms=6000)
    async with (
        Triggerer(settings, options) as triggerer,
        TopicReader(settings, names.resume()) as resume,
        TopicReader(settings, names.defer()) as defer,
        TopicReader(settings, names.dead) as dead,
    ):
        await publish(kafka_clients, settings, inbox_watch("once-1", inbox, once=True))
        await publish(kafka_clients, settings, refused)
        drop(inbox, "a1", "end-a2")
        await until(
            lambda: {b"once-1", b"refused-1"} <= defer.tombstones(), within=30, what="both ended"
        )
        await until(lambda: len(watch_events(resume)) >= 3, within=30, what="their events")
        await until(lambda: triggerer.lanes[0].watching == 0, within=30, what="none left")
        drop(inbox, "b1")
        await asyncio.sleep(0)  # nothing runs to take it (no wait could show more)
        assert (inbox / "b1").exists()
        assert "once-1" not in triggerer.supervisor
        await until(lambda: dead.values(), within=30, what="the dead letter")

    once = [e for e in watch_events(resume) if e.trigger_id == "once-1"]
    assert [(e.payload["name"], e.seq, e.last) for e in once] == [
        ("a1", 1, False),
        ("end-a2", 2, True),
    ]
    [failed] = [e for e in watch_events(resume) if e.trigger_id == "refused-1"]
    assert (failed.status, failed.run, failed.seq, failed.last) == ("failed", "rejected", 1, True)
    assert "not under an allowed" in (failed.error or "")
    [letter] = dead.values()
    assert isinstance(letter, DeadLetter)
    assert letter.trigger_id == "refused-1"
    assert letter.value == encode(refused)


async def test_a_watch_moves_to_another_member_when_its_owner_is_killed(
    settings: Settings,
    kafka_clients: KafkaClients,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGKILL between two files: the survivor takes the partition over and its own run
    takes the next file; every file is one event, none twice."""
    settings = watch_settings(settings)
    names = TopicNames(settings.topic_prefix)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    await ensure_topics(settings, topic_specs(settings))
    monkeypatch.setenv("DEFERLINE_ALLOWED_TRIGGER_PREFIXES", f"deferline.engine.triggers,{MODULE}")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[2]), prepend=os.pathsep)
    async with TopicReader(settings, names.resume()) as resume:
        members = [
            TriggererProcess(settings, name, tmp_path, *FAILOVER_FLAGS) for name in ("m1", "m2")
        ]
        try:
            await until(
                lambda: all(m.find("partitions assigned") for m in members),
                within=60,
                what="both members assigned",
            )
            await publish(kafka_clients, settings, inbox_watch("watch-2", inbox))
            drop(inbox, "f1")
            await until(lambda: len(watch_events(resume)) >= 1, within=30, what="first event")
            owner = next(m for m in members if m.member == watch_events(resume)[0].member)
            survivor = next(m for m in members if m is not owner)
            owner.kill()
            drop(inbox, "f2", "f3")
            await until(lambda: len(watch_events(resume)) >= 3, within=60, what="taken over")
        finally:
            for member in members:
                member.close()
    events = watch_events(resume)
    assert [e.payload["name"] for e in events] == ["f1", "f2", "f3"]
    assert [e.member for e in events] == [owner.member, survivor.member, survivor.member]
    assert len({e.event_id for e in events}) == 3
    assert events[1].run != events[0].run


@pytest.mark.brokers_differ(
    "on Apache Kafka a record's offset is committed in its event's transaction (no record "
    "read twice); on Tansu after the event is acked (a record read again is the same event)"
)
async def test_a_kafka_topic_watch_reads_every_record_through_its_owners_kill(
    settings: Settings,
    kafka_clients: KafkaClients,
    tmp_path: Path,
    broker_backend: str,
) -> None:
    """600 messages on a 3-partition topic, the watch's owner SIGKILLed after the first
    300 started coming out: one event per message, each named after its record; the
    group's offsets end at the topic's end."""
    names = TopicNames(settings.topic_prefix)
    source, group = f"{settings.topic_prefix}orders", f"{settings.topic_prefix}orders-watch"
    await ensure_topics(settings, topic_specs(settings))
    admin = await kafka_clients.admin()
    await admin.create_topics([NewTopic(source, num_partitions=3, replication_factor=1)])
    watch = WatchRequest(
        trigger_id="orders-watch",
        classpath="deferline.engine.triggers.KafkaWatchTrigger",
        kwargs={"topic": source, "group": group, "match": {"kind": "order"}},
    )
    producer = await kafka_clients.producer()

    async def orders(numbers: range) -> None:
        records = [(str(n).encode(), orjson.dumps({"kind": "order", "n": n})) for n in numbers]
        noise = [(b"x", orjson.dumps({"kind": "noise"}))] * 10  # matched by none
        await produce(producer, source, records + noise)

    def numbers(reader: TopicReader) -> list[int]:
        events = watch_events(reader)
        failed = [e for e in events if e.status != "fired"]
        assert not failed, f"a run failed: {failed[0].error}"
        return [e.payload["value"]["n"] for e in events]

    async with TopicReader(settings, names.resume()) as resume:
        members = [
            TriggererProcess(settings, name, tmp_path, *FAILOVER_FLAGS) for name in ("k1", "k2")
        ]
        try:
            await until(
                lambda: all(m.find("partitions assigned") for m in members),
                within=60,
                what="both members assigned",
            )
            await publish(kafka_clients, settings, watch)
            await orders(range(300))
            await until(lambda: len(numbers(resume)) >= 50, within=60, what="events coming out")
            owner = next(m for m in members if m.member == watch_events(resume)[0].member)
            owner.kill()
            await orders(range(300, 600))
            await until(
                lambda: set(numbers(resume)) == set(range(600)),
                within=90,
                what=lambda: f"every order's event ({len(set(numbers(resume)))} of 600)",
            )
            last = {
                TopicPartition(source, e.payload["partition"]): e.payload["offset"] + 1
                for e in sorted(watch_events(resume), key=lambda e: e.payload["offset"])
            }
            await until(
                partial(_committed_are, kafka_clients, group, last),
                within=30,
                what="the group's offsets past each partition's last order",
            )
        finally:
            for member in members:
                member.close()
    events = watch_events(resume)
    by_id: dict[str, list[WatchEvent]] = {}
    for event in events:
        by_id.setdefault(event.event_id, []).append(event)
    assert len(by_id) == 600
    for event_id, same in by_id.items():
        first = same[0]
        assert (first.run, first.seq) == (
            f"partition-{first.payload['partition']}",
            first.payload["offset"] + 1,
        ), event_id
        assert all(e.payload == first.payload for e in same), "one record, one event"
    if broker_backend != "tansu":
        assert len(events) == 600, "a record whose event was committed is not read again"


async def _committed_are(
    clients: KafkaClients, group: str, wanted: dict[TopicPartition, int]
) -> bool:
    """Whether the group's committed offsets are ``wanted`` (the noise after a partition's
    last order is committed with no event, so never)."""
    admin = await clients.admin()
    offsets = await admin.list_consumer_group_offsets(group, partitions=list(wanted))
    return {tp: offsets[tp].offset for tp in wanted if tp in offsets} == wanted
