"""Incremental rebalances: only moved partitions change hands, kept triggers never stop.

In-process members (so their counters and rebalance records can be read directly), plus a
subprocess churn test with SIGKILL and SIGTERM.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from deferline.runners.triggerer import Triggerer, TriggererOptions
from deferline.runners.triggerer.testing import RebalanceSummary
from deferline.schemas import CancelRequest, encode
from deferline.topics import Settings, TopicNames, ensure_topics, topic_specs

from tests._until import until
from tests.integration._triggerer_help import (
    FAILOVER_FLAGS,
    TopicReader,
    TriggererProcess,
    defer_request,
    partition_of,
    produce,
    produce_requests,
)
from tests.integration._util import KafkaClients

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PARTITIONS = 6


@pytest.fixture
def wide(settings: Settings) -> Settings:
    return settings.model_copy(update={"partitions": PARTITIONS})


def options(tmp_path: Path, member: str, **changes: Any) -> TriggererOptions:
    fields: dict[str, Any] = {
        "member": member,
        "state_dir": tmp_path / member,
        "session_timeout_ms": 6000,
    }
    fields.update(changes)
    return TriggererOptions(**fields)


class Group:
    """In-process members, stopped at the end whatever happened."""

    def __init__(self, settings: Settings, tmp_path: Path) -> None:
        self.settings = settings
        self.tmp_path = tmp_path
        self.members: dict[str, Triggerer] = {}

    async def start(self, member: str, **changes: Any) -> Triggerer:
        triggerer = Triggerer(self.settings, options(self.tmp_path, member, **changes))
        await triggerer.start()
        self.members[member] = triggerer
        return triggerer

    async def stop(self, member: str) -> None:
        await self.members.pop(member).stop()

    def owners(self) -> dict[int, str]:
        return {n: m for m, t in self.members.items() for n in t.lanes[0].owned}

    def settled(self) -> bool:
        """Every member rebuilt what it owns, and together they own every partition."""
        lanes = [t.lanes[0] for t in self.members.values()]
        ready = all(lane.bootstrapped.is_set() and lane.owned for lane in lanes)
        return ready and sorted(self.owners()) == list(range(PARTITIONS))

    async def aclose(self) -> None:
        for member in list(self.members):
            await self.stop(member)


@pytest.fixture
async def group(wide: Settings, tmp_path: Path) -> AsyncIterator[Group]:
    await ensure_topics(wide, topic_specs(wide))
    members = Group(wide, tmp_path)
    try:
        yield members
    finally:
        await members.aclose()


def log(triggerer: Triggerer) -> list[RebalanceSummary]:
    return list(triggerer.lanes[0].rebalance_log)


def cancelled(triggerer: Triggerer) -> float:
    return float(triggerer.supervisor.metrics.snapshot()["cancelled"])


def counter(triggerer: Triggerer, name: str, **labels: str) -> float:
    value = triggerer.metrics.registry.get_sample_value(name, {"queue": "default", **labels})
    return value or 0.0


@pytest.mark.brokers_differ(
    "generations and join timing differ; revocation flushes or closes transactions"
)
async def test_join_and_leave_move_only_the_moved_share_and_lose_nothing(
    group: Group, wide: Settings, kafka_clients: KafkaClients
) -> None:
    names = TopicNames(wide.topic_prefix)
    waiting = [defer_request(i, due_in=3600, run="wait") for i in range(1200)]
    due = [defer_request(i, due_in=2.0 + 16.0 * i / 1200, run="due") for i in range(1200)]
    producer = await kafka_clients.producer()
    await produce_requests(producer, wide, waiting)
    a = await group.start("a")
    b = await group.start("b")
    await until(group.settled, within=60, interval=0.1, what="a and b settled")
    async with TopicReader(wide, names.resume()) as events:
        await produce_requests(producer, wide, due)
        before = {m: set(t.lanes[0].owned) for m, t in group.members.items()}
        rebalances = {m: len(log(t)) for m, t in group.members.items()}
        generation = log(a)[-1].generation

        c = await group.start("c")
        await until(
            lambda: (
                group.settled()
                and all(len(log(t)) > rebalances[m] for m, t in [("a", a), ("b", b)])
            ),
            within=60,
            interval=0.1,
            what="a, b and c settled",
        )
        after = group.owners()
        assert sorted(len(t.lanes[0].owned) for t in group.members.values()) == [2, 2, 2]
        for member, triggerer in (("a", a), ("b", b)):
            summary = log(triggerer)[-1]
            assert set(summary.kept) | set(summary.lost) == before[member]
            assert summary.acquired == [], "a join moves partitions to the new member only"
            assert set(summary.kept) == {n for n, m in after.items() if m == member}
            assert summary.triggers_rebuilt == 0
            # Only the lost partitions' triggers were cancelled (fewer when one of them fired
            # first; its event was dropped): kept triggers never stopped.
            assert summary.lost
            assert summary.triggers_cancelled > 0
            assert cancelled(triggerer) <= sum(s.triggers_cancelled for s in log(triggerer))
            assert counter(
                triggerer, "deferline_triggerer_rebalance_triggers_total", action="cancelled"
            ) == sum(s.triggers_cancelled for s in log(triggerer))
            assert counter(
                triggerer, "deferline_triggerer_rebalance_triggers_total", action="kept"
            ) >= sum(s.triggers_kept for s in log(triggerer)[-1:])
        # One JoinGroup per member per rebalance, offering both assignors: the join is one
        # generation (two requests, one per assignor, made it two).
        assert {log(t)[-1].generation for t in group.members.values()} == {generation + 1}
        moved = [n for n in range(PARTITIONS) if after[n] == "c"]
        assert len(moved) == 2
        assert sorted(log(c)[-1].acquired) == moved

        rebalances = {m: len(log(t)) for m, t in group.members.items() if m != "c"}
        await group.stop("c")
        await until(
            lambda: (
                group.settled()
                and all(len(log(t)) > rebalances[m] for m, t in [("a", a), ("b", b)])
            ),
            within=60,
            interval=0.1,
            what="a and b took c's partitions",
        )
        for _member, triggerer in (("a", a), ("b", b)):
            summary = log(triggerer)[-1]
            assert summary.lost == [], "a leave moves only the leaver's partitions"
            assert set(summary.acquired) <= set(moved)
            assert summary.triggers_cancelled == 0
        await until(lambda: len(events.distinct_triggers()) == len(due), within=60, interval=0.2)
        await until(
            lambda: a.supervisor.running + b.supervisor.running == len(waiting),
            within=20,
            interval=0.05,
        )
    per_trigger = Counter(event.trigger_id for event in events.events())
    assert set(per_trigger) == {r.trigger_id for r in due}, "no trigger lost"
    assert set(per_trigger.values()) == {1}, "none emitted twice"


async def test_a_timer_due_during_the_rebalance_is_emitted_once_by_its_next_owner(
    group: Group, wide: Settings, kafka_clients: KafkaClients
) -> None:
    names = TopicNames(wide.topic_prefix)
    a = await group.start("a")
    b = await group.start("b")
    await until(group.settled, within=60, interval=0.1, what="a and b settled")
    # Due densely over the seconds around the join, so some fall due while it is underway:
    # 15 s of them, as a loaded machine may take several seconds to get the join under way.
    requests = [defer_request(i, due_in=1.0 + 15.0 * i / 3000) for i in range(3000)]
    producer = await kafka_clients.producer()
    async with TopicReader(wide, names.resume()) as events:
        await produce_requests(producer, wide, requests)
        await until(lambda: events.events(), within=20, interval=0.05, what="first events")
        counts = {m: len(log(t)) for m, t in group.members.items()}
        owner_before = group.owners()
        await group.start("c")
        await until(
            lambda: (
                group.settled() and all(len(log(t)) > counts[m] for m, t in [("a", a), ("b", b)])
            ),
            within=60,
            interval=0.1,
        )
        owner_after = group.owners()
        await until(
            lambda: len(events.distinct_triggers()) == len(requests), within=60, interval=0.2
        )
    quiet: dict[str, list[tuple[float, float]]] = {
        t.member: [
            (s.revoked_at, s.assigned_at)
            for s in log(t)[counts[t.member] :]
            if s.revoked_at is not None
        ]
        for t in (a, b)
    }
    assert quiet["a"], "a quiesced"
    assert quiet["b"], "b quiesced"
    per_trigger = Counter(event.trigger_id for event in events.events())
    assert set(per_trigger.values()) == {1}, "every trigger emitted exactly once"
    for event in events.events():
        emitted = event.emitted_at.timestamp()
        for start, end in quiet.get(event.member or "", []):
            assert not start < emitted < end, f"{event.member} emitted while quiesced"
    # Due while the partition's previous owner was quiesced: that owner could not emit it.
    in_window = [
        event
        for event in events.events()
        if event.due_at is not None
        and event.partition is not None
        and any(
            start <= event.due_at.timestamp() <= end
            for start, end in quiet[owner_before[event.partition]]
        )
    ]
    assert in_window, "some timers fell due while the members were quiesced"
    for event in in_window:
        assert event.partition == partition_of(event.trigger_id, PARTITIONS)
        assert event.member == owner_after[event.partition], (
            f"{event.trigger_id} due during the rebalance was emitted by {event.member}, "
            f"partition {event.partition} is owned by {owner_after[event.partition]}"
        )


async def test_a_static_member_restarted_in_time_gets_its_partitions_back_without_rebalance(
    group: Group, wide: Settings, kafka_clients: KafkaClients, broker_backend: str
) -> None:
    if broker_backend == "tansu":
        pytest.skip(
            "static membership: Tansu accepts group.instance.id but does not hand a rejoining "
            "static member its old place; the old member expires after the session timeout "
            "and the group rebalances"
        )
    waiting = [defer_request(i, due_in=3600) for i in range(600)]
    producer = await kafka_clients.producer()
    await produce_requests(producer, wide, waiting)
    static = {"static": True, "session_timeout_ms": 30_000}
    a = await group.start("a", **static)
    b = await group.start("b", **static)
    c = await group.start("c", **static)
    await until(group.settled, within=90, interval=0.1, what="a, b and c settled")
    owned_by_c = c.lanes[0].owned
    counts = {m: len(log(t)) for m, t in group.members.items()}
    await group.stop("c")
    c2 = await group.start("c", **static)
    await until(
        lambda: c2.lanes[0].bootstrapped.is_set() and c2.lanes[0].owned, within=30, interval=0.05
    )
    assert c2.lanes[0].owned == owned_by_c, "the same partitions came back"
    assert log(c2)[-1].acquired == owned_by_c
    assert counter(c2, "deferline_triggerer_bootstrap_records_total", topic="defer") == 0, (
        "rebuilt from the checkpoint, not from the defer topic"
    )
    # Nobody else saw a rebalance (leave one the time to happen if it were coming).
    await asyncio.sleep(3)
    assert {m: len(log(group.members[m])) for m in ("a", "b")} == {m: counts[m] for m in ("a", "b")}
    assert a.supervisor.running + b.supervisor.running + c2.supervisor.running == len(waiting)


# -- churn with real processes ----------------------------------------------------------------


@pytest.fixture
def spawn(wide: Settings, tmp_path: Path) -> Iterator[list[TriggererProcess]]:
    processes: list[TriggererProcess] = []
    yield processes
    for process in processes:
        process.close()


@pytest.mark.timeout(300)
async def test_kill_and_restart_churn_loses_nothing(
    wide: Settings, kafka_clients: KafkaClients, tmp_path: Path, spawn: list[TriggererProcess]
) -> None:
    names = TopicNames(wide.topic_prefix)
    await ensure_topics(wide, topic_specs(wide))

    def start(member: str) -> TriggererProcess:
        process = TriggererProcess(wide, member, tmp_path, *FAILOVER_FLAGS)
        spawn.append(process)
        return process

    live = {m: start(m) for m in ("a", "b", "c")}

    async def settled() -> bool:
        running = [p for p in live.values() if p.proc.poll() is None]
        if not all([await p.bootstrapped() for p in running]):
            return False
        owned = [n for p in running for n in p.find("partitions assigned")[-1]["partitions"]]
        return sorted(owned) == list(range(PARTITIONS))

    await until(settled, within=90, interval=0.2, what="three members settled")
    total = 20_000
    requests = [defer_request(i, due_in=2.0 + 25.0 * i / total) for i in range(total)]
    producer = await kafka_clients.producer()
    async with TopicReader(wide, names.resume()) as events:
        await produce_requests(producer, wide, requests)
        await until(lambda: len(events.distinct_triggers()) >= 1000, within=60, interval=0.1)
        live["a"].kill()
        await asyncio.sleep(2)  # down for a while: its partitions move after the session timeout
        live["a"] = start("a")
        await until(lambda: len(events.distinct_triggers()) >= 8000, within=90, interval=0.1)
        live["b"].terminate()
        assert live["b"].wait(60) == 0, "graceful stop exits cleanly"
        live["b"] = start("b")
        await until(lambda: len(events.distinct_triggers()) >= 14000, within=90, interval=0.1)
        live["c"].kill()
        live["c"] = start("c")
        await until(lambda: len(events.distinct_triggers()) == total, within=120, interval=0.5)
    ids: dict[str, set[str]] = defaultdict(set)
    for event in events.events():
        ids[event.trigger_id].add(event.event_id)
    assert set(ids) == {r.trigger_id for r in requests}, "0 lost"
    assert all(len(event_ids) == 1 for event_ids in ids.values()), "duplicates share an id"
    assert {event.status for event in events.events()} == {"fired"}, "0 wrong status"


async def test_every_queue_lane_rebalances_incrementally(
    group: Group, wide: Settings, kafka_clients: KafkaClients
) -> None:
    await ensure_topics(wide, topic_specs(wide, queues=["q"]))
    requests = [
        defer_request(i, due_in=3600, queue=q, run=f"r{q}") for i in range(300) for q in (None, "q")
    ]
    producer = await kafka_clients.producer()
    await produce_requests(producer, wide, requests)
    both = {"queues": (None, "q")}

    def settled() -> bool:
        lanes = [lane for t in group.members.values() for lane in t.lanes]
        if not all(lane.bootstrapped.is_set() and lane.owned for lane in lanes):
            return False
        return all(
            sorted(n for t in group.members.values() for n in t.lanes[i].owned)
            == list(range(PARTITIONS))
            for i in (0, 1)
        )

    a = await group.start("a", **both)
    b = await group.start("b", **both)
    await until(settled, within=60, interval=0.1, what="a and b settled on both queues")
    before = {(t.member, i): set(t.lanes[i].owned) for t in (a, b) for i in (0, 1)}
    counts = {
        key: len(t.lanes[key[1]].rebalance_log)
        for t in (a, b)
        for key in before
        if key[0] == t.member
    }
    await group.start("c", **both)
    await until(
        lambda: (
            settled()
            and all(
                len(group.members[m].lanes[i].rebalance_log) > n for (m, i), n in counts.items()
            )
        ),
        within=60,
        interval=0.1,
        what="a, b and c settled on both queues",
    )
    for (member, index), owned in before.items():
        lane = group.members[member].lanes[index]
        summary = lane.rebalance_log[-1]
        assert summary.acquired == [], (
            f"{lane.label}: a join moves partitions to the new member only"
        )
        assert set(summary.kept) == set(lane.owned)
        assert set(summary.kept) | set(summary.lost) == owned
    await until(
        lambda: sum(t.supervisor.running for t in group.members.values()) == len(requests),
        within=20,
        interval=0.05,
        what="every waiting trigger runs once across the three members",
    )


async def test_requests_arriving_while_a_partition_is_rebuilt_are_served_before_it_ends(
    group: Group, wide: Settings, kafka_clients: KafkaClients
) -> None:
    """The tail is followed while the folded triggers are still being started: a new request
    fires at once and exactly once, and a cancel of a folded trigger wins over its older
    DeferRequest whether that one was started yet or not."""
    names = TopicNames(wide.topic_prefix)
    waiting = [defer_request(i, due_in=3600, run="wait") for i in range(30_000)]
    old = defer_request(0, due_in=3600, run="old")  # the newest folded record: started last
    producer = await kafka_clients.producer()
    await produce_requests(producer, wide, [*waiting, old])
    async with TopicReader(wide, names.resume()) as events:
        a = await group.start("a", capacity=100_000)
        lane = a.lanes[0]
        await until(
            lambda: any(p.live and not p.ready for p in lane._parts.values()),
            within=60,
            interval=0.002,
            what="a partition follows its tail while its triggers are started",
        )
        probe = defer_request(1, due_in=0, run="probe")
        cancel = CancelRequest(trigger_id=old.trigger_id, task=old.task, reason="test")
        await produce_requests(producer, wide, [probe])
        await produce(producer, names.defer(), [(cancel.trigger_id.encode(), encode(cancel))])
        both = {probe.trigger_id, old.trigger_id}
        await until(lambda: events.distinct_triggers() == both, within=60, interval=0.05)
        await until(lane.bootstrapped.is_set, within=60, interval=0.01)
        await until(lambda: a.supervisor.running == len(waiting), within=30, interval=0.05)
    per_trigger = Counter(event.trigger_id for event in events.events())
    assert per_trigger == {probe.trigger_id: 1, old.trigger_id: 1}
    statuses = {event.trigger_id: event.status for event in events.events()}
    assert statuses == {probe.trigger_id: "fired", old.trigger_id: "cancelled"}
    assert old.trigger_id not in a.supervisor, "the older DeferRequest did not win"
    rebuilt_at = log(a)[-1].rebuilt_at
    assert rebuilt_at is not None
    fired = next(e for e in events.events() if e.trigger_id == probe.trigger_id)
    assert fired.emitted_at.timestamp() < rebuilt_at, "served before the rebuild ended"
