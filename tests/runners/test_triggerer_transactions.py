"""The emitter's transactional pipelines, one per owned defer partition (no broker: a fake
transactional producer that makes records visible only when their transaction commits)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError, ProducerFenced
from deferline.runners.triggerer._emitter import Emission, Emitter, Send

from tests.runners.test_triggerer_units import FakeBatch, FakeProducer


class FakeTransactionalProducer:
    """Stages the records of the open transaction; ``committed`` is what a reader in
    ``read_committed`` sees. ``fenced``: every later call fails as a fenced producer's does;
    ``fail_commits``: the next commits fail with these errors."""

    def __init__(self, *, fail_sends: dict[str, list[BaseException]] | None = None) -> None:
        self.inner = FakeProducer(fail=fail_sends)
        self.committed: list[Send] = []
        self.transactions = 0
        self.aborts = 0
        self.open = False
        self.fenced = False
        self.fail_commits: list[BaseException] = []
        self.hold: asyncio.Event | None = None
        """When given, commits wait for it (a transaction kept in flight)."""
        self.committing = asyncio.Event()
        """Set once a commit has begun."""

    def _check(self) -> None:
        if self.fenced:
            raise ProducerFenced()

    async def begin_transaction(self) -> None:
        self._check()
        assert not self.open, "one transaction at a time"
        self.open = True

    async def commit_transaction(self) -> None:
        self._check()
        assert self.open
        self.committing.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_commits:
            raise self.fail_commits.pop(0)
        self.committed += self.inner.sent
        self.inner.sent = []
        self.transactions += 1
        self.open = False

    async def abort_transaction(self) -> None:
        self._check()
        self.inner.sent = []
        self.aborts += 1
        self.open = False

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Any = (),
    ) -> asyncio.Future[Any]:
        self._check()
        return await self.inner.send(topic, value, key, partition, headers)

    def create_batch(self) -> FakeBatch:
        return FakeBatch()

    async def send_batch(
        self, batch: FakeBatch, topic: str, *, partition: int
    ) -> asyncio.Future[Any]:
        self._check()
        return await self.inner.send_batch(batch, topic, partition=partition)


def event(key: bytes, owner: str | None = "t.0", **callbacks: Any) -> Emission:
    return Emission(
        sends=[Send("resume", key, b"event", 0), Send("tasks.events", key, b"event", 5)],
        tombstone=Send("defer", key, None, 0),
        owner=owner,
        **callbacks,
    )


async def test_an_event_its_copy_and_its_tombstone_commit_in_one_transaction() -> None:
    producer = FakeTransactionalProducer()
    acked: list[list[int]] = []
    done = asyncio.Event()
    async with Emitter(FakeProducer()) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        emitter.submit(
            event(
                b"k", on_acked=lambda meta: acked.append([m.offset for m in meta]), on_done=done.set
            )
        )
        assert await emitter.flush(5)
    assert done.is_set()
    assert acked == [[0, 0]]  # the event's and its copy's offsets, once committed
    assert producer.transactions == 1
    assert [(s.topic, s.value) for s in producer.committed] == [
        ("resume", b"event"),
        ("tasks.events", b"event"),
        ("defer", None),
    ]


async def test_a_burst_commits_in_few_transactions_each_record_once() -> None:
    producer = FakeTransactionalProducer()
    async with Emitter(FakeProducer(), max_batch=100) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        for i in range(1000):
            emitter.submit(event(str(i).encode()))
        assert await emitter.flush(5)
        assert emitter.backlog == 0
    assert 10 <= producer.transactions <= 1000 // 100 + 1
    for topic in ("resume", "tasks.events", "defer"):
        keys = [s.key or b"" for s in producer.committed if s.topic == topic]
        assert sorted(keys) == sorted(str(i).encode() for i in range(1000))


async def test_a_failed_send_aborts_the_batch_which_then_commits_once() -> None:
    producer = FakeTransactionalProducer(fail_sends={"tasks.events": [KafkaTimeoutError()]})
    async with Emitter(FakeProducer(), retry_backoff=0.01) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        emitter.submit(event(b"a"))
        emitter.submit(event(b"b"))
        assert await emitter.flush(5)
    assert producer.aborts == 1
    assert sorted(s.key or b"" for s in producer.committed if s.topic == "resume") == [b"a", b"b"]
    assert len(producer.committed) == 6  # nothing of the aborted attempt


async def test_a_failed_commit_is_aborted_and_the_batch_sent_again_whole() -> None:
    producer = FakeTransactionalProducer()
    producer.fail_commits = [KafkaTimeoutError()]
    acked: list[object] = []
    async with Emitter(FakeProducer(), retry_backoff=0.01) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        emitter.submit(event(b"k", on_acked=acked.append))
        assert await emitter.flush(5)
    assert (producer.aborts, producer.transactions, len(acked)) == (1, 1, 1)
    assert [s.topic for s in producer.committed] == ["resume", "tasks.events", "defer"]


async def test_a_record_too_large_is_given_up_and_its_batch_mates_commit() -> None:
    producer = FakeTransactionalProducer()
    failed: list[BaseException] = []
    too_large = Emission(
        sends=[Send("resume", b"big", b"x" * 20_000, 0)],
        tombstone=Send("defer", b"big", None, 0),
        owner="t.0",
        on_failed=failed.append,
    )
    async with Emitter(FakeProducer(), retry_backoff=0.01, give_up_after=3) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        emitter.submit(too_large)
        emitter.submit(event(b"ok"))
        assert await emitter.flush(5)
    assert len(failed) == 1
    assert isinstance(failed[0], MessageSizeTooLargeError)
    assert {s.key for s in producer.committed} == {b"ok"}


async def test_a_fenced_partition_drops_its_emissions_and_says_so_once() -> None:
    producer = FakeTransactionalProducer()
    producer.fenced = True
    fenced: list[str] = []
    shared = FakeProducer()
    async with Emitter(shared) as emitter:
        emitter.open("t.0", producer, on_fenced=fenced.append)
        emitter.submit(event(b"a"))
        assert await emitter.flush(5)
        emitter.submit(event(b"b"))  # after the fence: dropped at once
        emitter.submit(event(b"c", owner=None))  # another path: still written
        assert await emitter.flush(5)
        assert emitter.backlog == 0
        assert await emitter.close("t.0") is producer
    assert fenced == ["t.0"]
    assert producer.committed == []
    assert [s.key for s in shared.sent if s.topic == "resume"] == [b"c"]


async def test_an_emission_of_a_partition_not_open_is_dropped() -> None:
    async with Emitter(FakeProducer()) as emitter:
        emitter.submit(event(b"k", owner="t.9"))
        assert emitter.backlog == 0
        assert await emitter.flush(0.1)


async def test_closing_mid_transaction_aborts_it_and_forgets_its_emissions() -> None:
    producer = FakeTransactionalProducer()
    producer.hold = asyncio.Event()  # the commit never comes back on its own
    async with Emitter(FakeProducer()) as emitter:
        emitter.open("t.0", producer, on_fenced=lambda tid: None)
        emitter.submit(event(b"a"))
        emitter.submit(event(b"b"))
        await asyncio.wait_for(producer.committing.wait(), 5)
        assert emitter.backlog == 2
        assert await emitter.close("t.0") is producer
        assert emitter.backlog == 0
        assert await emitter.close("t.0") is None
    assert producer.aborts == 1
    assert producer.committed == []


async def test_a_partition_opened_twice_is_refused() -> None:
    async with Emitter(FakeProducer()) as emitter:
        emitter.open("t.0", FakeTransactionalProducer(), on_fenced=lambda tid: None)
        with pytest.raises(ValueError, match=r"t\.0 is already open"):
            emitter.open("t.0", FakeTransactionalProducer(), on_fenced=lambda tid: None)
