"""The bridge's event loop batches what arrives during a write, and waits for nothing else;
with several writers, offsets are committed in the order read."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from deferline.runners.airflow_bridge.testing import CleanUpSchedule, write_back_loop

from tests._until import until

pytestmark = pytest.mark.timeout(10)


class FakeSource:
    """Records put in by the test, handed out by ``getmany`` as aiokafka does (at most
    ``max_records``, waiting up to ``timeout_ms`` when there are none)."""

    def __init__(self) -> None:
        self.records: list[int] = []
        self.arrived = asyncio.Event()
        self.asked: list[int | None] = []

    def put(self, *records: int) -> None:
        self.records += records
        self.arrived.set()

    async def getmany(
        self, *partitions: Any, timeout_ms: int = 0, max_records: int | None = None
    ) -> Mapping[Any, Sequence[Any]]:
        self.asked.append(max_records)
        if not self.records:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout_ms / 1000)
            except TimeoutError:
                return {}
        taken = self.records[:max_records]
        del self.records[: len(taken)]
        return {"tp": taken}


class Writer:
    """Records each batch; a write ends when the test releases it."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, records: list[int]) -> None:
        self.batches.append(list(records))
        self.started.set()
        await self.release.wait()
        self.release.clear()
        self.started.clear()


class Commits:
    """The batches committed, in order."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    async def __call__(self, records: list[int]) -> None:
        self.batches.append(list(records))


class EachReleased:
    """A writer whose writes run at once, each ended by the test (``finish``) in any order."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self._ends: dict[int, asyncio.Future[None]] = {}

    async def __call__(self, records: list[int]) -> None:
        end = asyncio.get_running_loop().create_future()
        self._ends[records[0]] = end
        self.batches.append(list(records))
        await end

    def finish(self, first: int, error: Exception | None = None) -> None:
        end = self._ends[first]
        if error is None:
            end.set_result(None)
        else:
            end.set_exception(error)


async def test_a_lone_event_is_written_at_once_and_a_burst_in_the_next_batch() -> None:
    source, write, commit = FakeSource(), Writer(), Commits()
    loop = asyncio.create_task(write_back_loop(source, write, commit, max_records=5, timeout_ms=50))
    try:
        source.put(1)
        await asyncio.wait_for(write.started.wait(), 1)
        assert write.batches == [[1]]
        # While the first write runs, a burst arrives: all of it (up to max_records) is
        # the next batch, the rest the one after.
        source.put(2, 3, 4, 5, 6, 7, 8)
        await until(lambda: len(source.records) == 2)
        write.release.set()
        await until(lambda: len(write.batches) == 2)
        assert write.batches[1] == [2, 3, 4, 5, 6]
        write.release.set()
        await until(lambda: len(write.batches) == 3)
        assert write.batches[2] == [7, 8]
        write.release.set()
        await until(lambda: len(commit.batches) == 3)
        assert commit.batches == write.batches  # each committed once written, one at a time
        # Never more read than one batch holds while a write runs.
        assert all(asked is not None and 1 <= asked <= 5 for asked in source.asked)
    finally:
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop


async def test_records_are_read_as_they_arrive_while_a_write_runs() -> None:
    source, write = FakeSource(), Writer()
    read: list[int] = []

    def reader(record: int) -> int:
        read.append(record)
        return -record

    loop = asyncio.create_task(
        write_back_loop(source, write, Commits(), max_records=5, timeout_ms=50, read=reader)
    )
    try:
        source.put(1)
        await asyncio.wait_for(write.started.wait(), 1)
        source.put(2, 3)
        await until(lambda: read == [1, 2, 3])  # the first write still running
        assert write.batches == [[-1]]
        write.release.set()
        await until(lambda: len(write.batches) == 2)
        assert write.batches[1] == [-2, -3]
        write.release.set()
    finally:
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop


async def test_a_failed_write_ends_the_loop_with_its_error() -> None:
    source = FakeSource()

    async def broken(records: list[int]) -> None:
        raise RuntimeError("database gone")

    source.put(1)
    with pytest.raises(RuntimeError, match="database gone"):
        await write_back_loop(source, broken, Commits(), max_records=5, timeout_ms=50)


async def test_two_writers_write_at_once_and_commit_in_the_order_read() -> None:
    source, write, commit = FakeSource(), EachReleased(), Commits()
    loop = asyncio.create_task(
        write_back_loop(source, write, commit, max_records=5, writers=2, timeout_ms=50)
    )
    try:
        source.put(1)
        await until(lambda: write.batches == [[1]])
        source.put(2, 3)  # a backlog of max_records / writers: a second write beside the first
        await until(lambda: write.batches == [[1], [2, 3]])
        source.put(4, 5, 6)
        await until(lambda: not source.records)  # read, but no third writer: it waits
        assert write.batches == [[1], [2, 3]]
        write.finish(2)
        await until(lambda: write.batches == [[1], [2, 3], [4, 5, 6]])
        assert commit.batches == []  # [2, 3] is written, but [1] before it is not yet
        source.put(7)  # below the backlog that takes a second writer: waits for the first
        await until(lambda: not source.records)
        write.finish(1)
        await until(lambda: commit.batches == [[1], [2, 3]])
        write.finish(4)
        await until(lambda: write.batches[-1] == [7])
        assert commit.batches == [[1], [2, 3], [4, 5, 6]]
        write.finish(7)
        await until(lambda: commit.batches == [[1], [2, 3], [4, 5, 6], [7]])
    finally:
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop


async def test_a_failed_write_ends_the_loop_and_nothing_after_it_is_committed() -> None:
    source, write, commit = FakeSource(), EachReleased(), Commits()
    loop = asyncio.create_task(
        write_back_loop(source, write, commit, max_records=5, writers=2, timeout_ms=50)
    )
    source.put(1)
    await until(lambda: write.batches == [[1]])
    source.put(2, 3)
    await until(lambda: write.batches == [[1], [2, 3]])
    write.finish(2)
    write.finish(1, RuntimeError("database gone"))
    with pytest.raises(RuntimeError, match="database gone"):
        await loop
    assert commit.batches == []


@pytest.mark.parametrize(("max_records", "writers"), [(0, 1), (5, 0)])
async def test_max_records_or_writers_below_one_is_refused(max_records: int, writers: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        await write_back_loop(
            FakeSource(), Writer(), Commits(), max_records=max_records, writers=writers
        )


def test_clean_up_waits_while_batches_are_written_up_to_its_longest() -> None:
    schedule = CleanUpSchedule(quiet=1.0, longest=30.0)
    assert schedule.due(0.0)  # nothing written yet
    schedule.cleaned(0.0)
    schedule.write_started()
    assert not schedule.due(5.0)  # a batch running
    schedule.write_started()  # a second writer
    schedule.write_ended(5.0)
    assert not schedule.due(6.5)  # the other still writes
    schedule.write_ended(5.0)
    assert not schedule.due(5.5)  # the next batch of a burst may follow at once
    assert schedule.due(6.0)  # a second without a batch: the burst is over
    schedule.write_started()
    assert not schedule.due(29.9)
    assert schedule.due(30.0)  # batch after batch: not put off longer than longest
    schedule.cleaned(30.0)
    assert not schedule.due(31.0)
