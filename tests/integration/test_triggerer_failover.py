"""Several ``deferline triggerer`` processes: sharing, SIGKILL failover, scaling out and in.

Every trigger must fire; duplicates (a trigger re-run after its owner died) must carry the
same event id, so that after dedup by event id each trigger fired exactly once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from deferline.schemas import TriggerEventRecord
from deferline.topics import Settings, TopicNames, ensure_topics, topic_specs

from tests._until import until
from tests.integration._triggerer_help import (
    FAILOVER_FLAGS,
    TopicReader,
    TriggererProcess,
    defer_request,
    owners,
    partition_of,
    produce_requests,
)
from tests.integration._util import KafkaClients

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PARTITIONS = 6


@pytest.fixture
def wide(settings: Settings) -> Settings:
    """The test's settings with more partitions, so three members all get some."""
    return settings.model_copy(update={"partitions": PARTITIONS})


@pytest.fixture
def spawn(wide: Settings, tmp_path: Path) -> Iterator[list[TriggererProcess]]:
    """Started processes, killed at the end whatever happened."""
    processes: list[TriggererProcess] = []
    yield processes
    for process in processes:
        process.close()


def start(wide: Settings, tmp_path: Path, processes: list[TriggererProcess], member: str) -> None:
    processes.append(TriggererProcess(wide, member, tmp_path, *FAILOVER_FLAGS))


async def settled(processes: list[TriggererProcess]) -> bool:
    """Every live member rebuilt its partitions and together they own all of them."""
    live = [p for p in processes if p.proc.poll() is None]
    for process in live:
        if not await process.bootstrapped():
            return False
    owned = [n for p in live for n in p.find("partitions assigned")[-1]["partitions"]]
    return sorted(owned) == list(range(PARTITIONS))


def once_each(events: list[TriggerEventRecord]) -> dict[str, set[str]]:
    ids: dict[str, set[str]] = defaultdict(set)
    for event in events:
        ids[event.trigger_id].add(event.event_id)
    return ids


async def test_members_share_triggers_and_each_fires_once_on_its_owner(
    wide: Settings, kafka_clients: KafkaClients, tmp_path: Path, spawn: list[TriggererProcess]
) -> None:
    names = TopicNames(wide.topic_prefix)
    await ensure_topics(wide, topic_specs(wide))
    for member in ("a", "b", "c"):
        start(wide, tmp_path, spawn, member)
    await until(lambda: settled(spawn), within=60, interval=0.2, what="group settled")
    ownership = await owners(spawn)
    requests = [defer_request(i, due_in=1.0) for i in range(3000)]
    async with TopicReader(wide, names.resume()) as events:
        producer = await kafka_clients.producer()
        await produce_requests(producer, wide, requests)
        await until(lambda: len(events.distinct_triggers()) == 3000, within=60, interval=0.2)
    fired = events.events()
    ids = once_each(fired)
    assert set(ids) == {r.trigger_id for r in requests}
    assert all(len(event_ids) == 1 for event_ids in ids.values())
    for event in fired:
        assert event.partition == partition_of(event.trigger_id, PARTITIONS)
        assert event.member == ownership[event.partition], "fired by the partition's owner"
    assert {event.member for event in fired} == {"a", "b", "c"}


@pytest.mark.brokers_differ(
    "a SIGKILL mid-write aborts a transaction on Kafka, re-emits under the same event id on Tansu"
)
async def test_sigkill_of_a_member_under_load_loses_nothing(
    wide: Settings, kafka_clients: KafkaClients, tmp_path: Path, spawn: list[TriggererProcess]
) -> None:
    names = TopicNames(wide.topic_prefix)
    await ensure_topics(wide, topic_specs(wide))
    for member in ("a", "b", "c"):
        start(wide, tmp_path, spawn, member)
    await until(lambda: settled(spawn), within=60, interval=0.2, what="group settled")
    # Due over eight seconds: some fire before the kill, the rest during and after failover.
    requests = [defer_request(i, due_in=1.0 + 8.0 * i / 2000) for i in range(2000)]
    victim = spawn[0]
    async with TopicReader(wide, names.resume()) as events:
        producer = await kafka_clients.producer()
        await produce_requests(producer, wide, requests)
        await until(lambda: len(events.distinct_triggers()) >= 300, within=30, interval=0.1)
        victim.kill()
        await until(lambda: len(events.distinct_triggers()) == 2000, within=60, interval=0.2)
    ids = once_each(events.events())
    assert set(ids) == {r.trigger_id for r in requests}, "no trigger lost"
    assert all(len(event_ids) == 1 for event_ids in ids.values()), "duplicates share an id"
    survivors = {e.member for e in events.events()} - {victim.member}
    assert survivors == {"b", "c"}


async def test_scale_out_to_three_and_back_to_one_loses_nothing(
    wide: Settings, kafka_clients: KafkaClients, tmp_path: Path, spawn: list[TriggererProcess]
) -> None:
    names = TopicNames(wide.topic_prefix)
    await ensure_topics(wide, topic_specs(wide))
    start(wide, tmp_path, spawn, "a")
    await until(lambda: settled(spawn), within=60, interval=0.2, what="first member ready")
    requests = [defer_request(i, due_in=1.0 + 14.0 * i / 1500) for i in range(1500)]
    async with TopicReader(wide, names.resume()) as events:
        producer = await kafka_clients.producer()
        await produce_requests(producer, wide, requests)
        await until(lambda: events.events(), within=20, interval=0.1)
        start(wide, tmp_path, spawn, "b")
        start(wide, tmp_path, spawn, "c")
        await until(lambda: settled(spawn), within=60, interval=0.2, what="three members")
        for process in spawn[1:]:
            process.terminate()
        for process in spawn[1:]:
            assert process.wait(30) == 0, "graceful stop exits cleanly"
        await until(lambda: settled(spawn), within=60, interval=0.2, what="back to one")
        await until(lambda: len(events.distinct_triggers()) == 1500, within=60, interval=0.2)
    ids = once_each(events.events())
    assert set(ids) == {r.trigger_id for r in requests}
    assert all(len(event_ids) == 1 for event_ids in ids.values())
    assert {e.member for e in events.events()} == {"a", "b", "c"}, "all three fired some"


@pytest.mark.kafka_only  # Tansu has no transactions: there the scheduler drops repeats by id
async def test_a_paused_member_is_fenced_and_each_event_is_written_once(
    wide: Settings, kafka_clients: KafkaClients, tmp_path: Path, spawn: list[TriggererProcess]
) -> None:
    """A member paused (SIGSTOP) past its session wakes still running the triggers of the
    partitions it lost: its writes for them are fenced by the new owner's producers, so a
    reader in read_committed sees every event once on the resume topic and on tasks.events."""
    names = TopicNames(wide.topic_prefix)
    await ensure_topics(wide, topic_specs(wide))
    for member in ("a", "b"):
        start(wide, tmp_path, spawn, member)
    await until(lambda: settled(spawn), within=60, interval=0.2, what="group settled")
    paused, other = spawn
    requests = [defer_request(i, due_in=1.0 + 12.0 * i / 2000) for i in range(2000)]
    async with (
        TopicReader(wide, names.resume()) as events,
        TopicReader(wide, names.task_events) as copies,
    ):
        producer = await kafka_clients.producer()
        await produce_requests(producer, wide, requests)
        await until(lambda: len(events.distinct_triggers()) >= 300, within=30, interval=0.1)
        paused.pause()
        await until(
            lambda: other_owns_all(other), within=60, interval=0.1, what="the other took over"
        )
        paused.resume()  # its due timers fire at once, for partitions it no longer owns
        await until(lambda: len(copies.distinct_triggers()) == 2000, within=60, interval=0.2)
        await until(lambda: settled(spawn), within=60, interval=0.2, what="shared again")
    for reader in (events, copies):
        counts: dict[str, int] = defaultdict(int)
        for event in reader.events():
            counts[event.trigger_id] += 1
        assert set(counts) == {r.trigger_id for r in requests}, "no trigger lost"
        repeated = {t: n for t, n in counts.items() if n > 1}
        fenced = len(paused.find("partition fenced"))
        assert not repeated, f"{reader.topic}: written more than once ({fenced} fenced lines)"


async def other_owns_all(process: TriggererProcess) -> bool:
    assigned = process.find("partitions assigned")
    return (
        bool(assigned)
        and sorted(assigned[-1]["partitions"]) == list(range(PARTITIONS))
        and await process.bootstrapped()
    )
