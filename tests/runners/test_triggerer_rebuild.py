"""Starting a rebuilt partition's triggers while its tail is already applied (no broker)."""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition
from deferline.runners.triggerer.testing import (
    ActiveTriggerTable,
    OwnedPartition,
    RebuildPlan,
    Span,
    start_folded,
)
from deferline.schemas import WatchEvent, WatchRequest, encode, make_watch_event_id


class Count:
    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class Starts:
    """What ``start_folded`` is given: ``dispatch`` records what it is given, and may run a
    tail step (what the live tail does between two slices) right after a given key."""

    def __init__(self, work: int = 0) -> None:
        self.dispatched: list[tuple[bytes | None, bytes, int]] = []
        self.tail_after: dict[bytes, list[tuple[bytes, bytes | None]]] = {}
        self.work = work
        self._deferrals = Count()

    async def _start_folded(
        self,
        parts: list[OwnedPartition],
        emitted: dict[int, dict[bytes, tuple[int, bytes | None]]],
        committed: dict[int, int],
    ) -> int:
        plans = [
            RebuildPlan(
                number=part.number,
                defer=Span(begin=0, end=part.table.defer_offset),
                resume=Span(begin=0, end=0),
                committed=committed.get(part.number, 0),
                table=part.table,
                from_checkpoint=False,
                emitted=emitted[part.number],
            )
            for part in parts
        ]
        return await start_folded(plans, parts, self._dispatch, self._deferrals)

    def _dispatch(self, part: OwnedPartition, key: bytes | None, value: bytes, offset: int) -> bool:
        self.dispatched.append((key, value, offset))
        for _ in range(self.work):  # a few microseconds, as decoding a request takes
            pass
        assert key is not None
        for tail_key, tail_value in self.tail_after.pop(key, []):
            # The live tail: fold the record, then act on it (start it, or drop it on a tombstone).
            table = part.table
            tail_offset = table.defer_offset
            table.apply(tail_key, tail_value, offset=tail_offset, timestamp=9_000 + tail_offset)
            if tail_value is not None:
                self._dispatch(part, tail_key, tail_value, tail_offset)
        return True


def partition(records: list[tuple[bytes, bytes]]) -> OwnedPartition:
    part = OwnedPartition(
        number=0, defer_tp=TopicPartition("p.defer", 0), resume_tp=TopicPartition("p.resume", 0)
    )
    part.table = ActiveTriggerTable()
    for offset, (key, value) in enumerate(records):
        part.table.apply(key, value, offset=offset, timestamp=1_000 + offset)
    return part


def test_folded_triggers_start_in_log_order_and_skip_what_already_fired() -> None:
    lane = Starts()
    part = partition([(b"a", b"a0"), (b"b", b"b0"), (b"c", b"c0")])
    started = asyncio.run(lane._start_folded([part], {0: {b"b": (7, b"event")}}, {}))
    assert started == 2
    assert lane._deferrals.value == 2
    assert lane.dispatched == [(b"a", b"a0", 0), (b"c", b"c0", 2)]


def test_records_no_member_served_yet_start_first() -> None:
    lane = Starts()
    part = partition([(b"a", b"a0"), (b"b", b"b0"), (b"c", b"c0"), (b"d", b"d0")])
    # The previous owner committed offset 2 when it quiesced: c and d came during the rebalance.
    started = asyncio.run(lane._start_folded([part], {0: {}}, {0: 2}))
    assert started == 4
    assert [key for key, _, _ in lane.dispatched] == [b"c", b"d", b"a", b"b"]


def test_a_tail_record_during_the_start_wins_over_the_older_folded_one() -> None:
    lane = Starts()
    part = partition([(b"a", b"a0"), (b"b", b"b0"), (b"c", b"c0")])
    # Past the committed offset, "c" is started first; meanwhile the tail brings a newer "a"
    # and a tombstone of "b".
    lane.tail_after[b"c"] = [(b"a", b"a1"), (b"b", None)]
    started = asyncio.run(lane._start_folded([part], {0: {}}, {0: 2}))
    assert lane.dispatched == [(b"c", b"c0", 2), (b"a", b"a1", 3)]
    assert started == 1  # "c" from the fold; "a" came from the tail, "b" was tombstoned
    entry = part.table.get(b"a")
    assert entry is not None
    assert entry.value == b"a1"
    assert b"b" not in part.table


def test_starting_gives_the_loop_back_between_slices() -> None:
    lane = Starts(work=1000)
    part = partition([(f"k{i}".encode(), b"v") for i in range(20_000)])
    ticks = 0

    async def ticker(done: asyncio.Event) -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    async def main() -> int:
        done = asyncio.Event()
        task = asyncio.create_task(ticker(done))
        await asyncio.sleep(0)
        started = await lane._start_folded([part], {0: {}}, {})
        done.set()
        await task
        return started

    assert asyncio.run(main()) == 20_000
    assert ticks > 5, "other tasks ran between slices"


def test_a_watchs_events_on_the_resume_topic_do_not_end_it() -> None:
    """The rebuild tombstones a trigger whose event is already out; a standing watch's
    events end nothing, so it is started again."""
    watch = encode(WatchRequest(trigger_id="w", classpath="x.Watch"))
    event = encode(
        WatchEvent(
            event_id=make_watch_event_id("w", "r1", 1),
            trigger_id="w",
            run="r1",
            seq=1,
            status="fired",
        )
    )
    fired = b'{"kind": "trigger_event"}'
    part = partition([(b"w", watch), (b"t", b"{}")])
    plan = RebuildPlan(
        number=0,
        defer=Span(begin=0, end=2),
        resume=Span(begin=0, end=2),
        committed=0,
        table=part.table,
        from_checkpoint=False,
    )
    plan.collect([_Resume(b"w", event, 0), _Resume(b"t", fired, 1)])
    assert [key for key, _ in plan.already_emitted()] == [b"t"]


def test_a_watch_run_once_ends_with_its_last_event_and_a_standing_one_does_not() -> None:
    """A ``once`` watch (a deadline-alert callback) whose last event is out gets only its
    tombstone (it must not run again); a standing watch's last event ends only that run."""

    def last_event(trigger_id: str) -> bytes:
        return encode(
            WatchEvent(
                event_id=make_watch_event_id(trigger_id, "r1", 2),
                trigger_id=trigger_id,
                run="r1",
                seq=2,
                status="fired",
                last=True,
            )
        )

    once = encode(WatchRequest(trigger_id="c", classpath="x.Callback", once=True))
    standing = encode(WatchRequest(trigger_id="w", classpath="x.Watch"))
    part = partition([(b"c", once), (b"w", standing)])
    plan = RebuildPlan(
        number=0,
        defer=Span(begin=0, end=2),
        resume=Span(begin=0, end=2),
        committed=0,
        table=part.table,
        from_checkpoint=False,
    )
    plan.collect([_Resume(b"c", last_event("c"), 0), _Resume(b"w", last_event("w"), 1)])
    assert list(plan.already_emitted()) == [(b"c", (0, None))]  # no tasks.events copy


class _Resume:
    def __init__(self, key: bytes, value: bytes, offset: int) -> None:
        self.key, self.value, self.offset, self.timestamp = key, value, offset, 0
