"""In-memory Kafka for unit tests: one log per topic-partition, and the clients over it.

:class:`FakeKafka` is the broker: producers append to its logs and consumers read them, so a
fake producer and a fake consumer in one test see the same records. The clients implement the
part of aiokafka's that deferline calls, with aiokafka's records (``ConsumerRecord``,
``RecordMetadata``), errors and semantics:

- offsets count from 0 in each partition; a send is acknowledged one loop turn after it is
  made (its records are written then), in the order the sends were made;
- a record over ``max_request_size`` is refused by ``send`` (``MessageSizeTooLargeError``);
  a batch over it is refused by the broker (its future fails with the same error);
- transactions: the records of an open transaction take their offsets at once, but a
  ``read_committed`` consumer reads nothing at or past the first of them (the last stable
  offset) until the transaction ends; a commit or an abort writes a marker in each partition
  it touched, which takes an offset and is no record; an aborted transaction's records are
  read ``read_uncommitted`` only; offsets sent to a transaction become the group's when it
  commits;
- a transactional producer started with the id of another fences it: the other's open
  transaction is aborted, and every later request of the other fails with
  ``ProducerFenced`` (its sends' futures; its offsets, commits and aborts raise it; its
  ``begin_transaction`` does not, being the client's alone, as in aiokafka);
- ``assign`` forgets positions: a partition's position is then its group's committed offset,
  else where ``auto_offset_reset`` says; a consumer's position passes the markers and aborted
  records it reads over.

tests/test_fakes_contract.py runs the same behavioural cases against these fakes and a real
broker. Not modelled: retention and compaction (every log starts at 0), group membership
(``subscribe``, rebalances), an out-of-range position's reset, and the network. A producer's
first use of a topic creates it with ``FakeKafka.partitions`` partitions, as a broker with
``auto.create.topics.enable`` does.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import TopicPartition
from aiokafka.errors import (
    ConsumerStoppedError,
    IllegalOperation,
    IllegalStateError,
    MessageSizeTooLargeError,
    NoOffsetForPartitionError,
    ProducerFenced,
    TopicAlreadyExistsError,
)
from aiokafka.structs import ConsumerRecord, OffsetAndTimestamp, RecordMetadata
from deferline.runners.member import MemberFigures, MemberProducer
from deferline.runners.testing import GroupMetadata
from deferline.topics import Settings, partition_for

__all__ = [
    "FakeBatch",
    "FakeClient",
    "FakeCluster",
    "FakeConsumer",
    "FakeKafka",
    "FakeProducer",
    "FakeTransactionalProducer",
    "Isolation",
    "JournalEntry",
]

Isolation = Literal["read_committed", "read_uncommitted"]
Headers = list[tuple[str, bytes]]
JournalEntry = tuple[str, str, bytes | None]
"""What a producer did: (``send``/``ack``/``error``, topic, key) per record, (``begin``/
``commit``/``abort``/``stop``, "", None) for the rest."""

_RECORD_OVERHEAD = 21  # bytes a record takes beside its key, value and headers (about)
_BATCH_OVERHEAD = 61  # bytes of a record batch's header


def _record_size(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, Any]]) -> int:
    """About the bytes a record takes in a batch (aiokafka computes it exactly)."""
    size = _RECORD_OVERHEAD + len(key or b"") + len(value or b"")
    return size + sum(len(name.encode()) + len(data or b"") + 2 for name, data in headers)


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(eq=False)
class _Transaction:
    """One transaction of a transactional id, from its begin to its commit or abort."""

    transactional_id: str
    state: Literal["open", "committed", "aborted"] = "open"
    first: dict[TopicPartition, int] = field(default_factory=dict)
    """The offset of its first record in each partition it wrote to."""
    offsets: dict[str, dict[TopicPartition, int]] = field(default_factory=dict)
    """Offsets sent to it, per group: the groups' once it commits."""
    failed: BaseException | None = None
    """The error of a send of it that failed: it can only be aborted."""


@dataclass(eq=False, slots=True)
class _Entry:
    """One offset of a partition: a record, or a transaction's marker (``record`` None)."""

    record: ConsumerRecord | None
    transaction: _Transaction | None = None


class FakeKafka:
    """The broker: a log per topic-partition, the groups' committed offsets, and the
    transactional ids' epochs.

    Args:
        partitions: the partition count of a topic created by a producer's first use of it
            (``num.partitions``); :meth:`create_topic` chooses its own.
    """

    def __init__(self, *, partitions: int = 1) -> None:
        self.partitions = partitions
        self._topics: dict[str, int] = {}
        self._logs: dict[TopicPartition, list[_Entry]] = {}
        self._written: list[_Entry] = []  # every record, in the order it was written
        self._groups: dict[str, dict[TopicPartition, int]] = {}
        self._offset_commits: dict[str, list[dict[TopicPartition, int]]] = {}
        self._epochs: dict[str, int] = {}
        self._open: dict[str, _Transaction] = {}  # transactional id: its open transaction
        self._next_keyless: dict[str, itertools.count[int]] = {}
        self._waiters: set[asyncio.Event] = set()

    # -- for tests ------------------------------------------------------------------------

    def create_topic(self, topic: str, partitions: int) -> None:
        """Create ``topic`` with ``partitions`` partitions."""
        if topic in self._topics:
            raise TopicAlreadyExistsError(topic)
        self._topics[topic] = partitions

    def append(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        *,
        partition: int | None = None,
        headers: Headers | None = None,
        timestamp_ms: int | None = None,
    ) -> int:
        """Write one record at once, outside any transaction (as another client would);
        returns its offset."""
        count = self.ensure_topic(topic)
        if partition is None:
            partition = self.choose_partition(topic, key)
        assert 0 <= partition < count, f"{topic} has no partition {partition}"
        tp = TopicPartition(topic, partition)
        return int(self.write(tp, key, value, headers or [], timestamp_ms, None).offset)

    def records(
        self, topic: str | None = None, *, isolation_level: Isolation = "read_uncommitted"
    ) -> list[ConsumerRecord]:
        """The records (of ``topic``, or of every topic) a consumer reading with
        ``isolation_level`` gets now, in the order they were written."""
        return [
            entry.record
            for entry in self._written
            if entry.record is not None
            and (topic is None or entry.record.topic == topic)
            and entry.record.offset < self.end(_tp(entry.record), isolation_level)
            and self._readable(entry, isolation_level)
        ]

    def committed_offsets(self, group_id: str) -> dict[TopicPartition, int]:
        """The offsets ``group_id`` has committed."""
        return dict(self._groups.get(group_id, {}))

    def offset_commits(self, group_id: str) -> list[dict[TopicPartition, int]]:
        """Each offset commit of ``group_id`` (by a consumer, or a transaction that carried
        offsets), in order: what the offsets topic holds of it."""
        return [dict(offsets) for offsets in self._offset_commits.get(group_id, [])]

    # -- what the clients ask -------------------------------------------------------------

    def partitions_of(self, topic: str) -> set[int] | None:
        """The partitions of ``topic``; None when there is no such topic."""
        count = self._topics.get(topic)
        return None if count is None else set(range(count))

    def topics(self) -> set[str]:
        return set(self._topics)

    def ensure_topic(self, topic: str) -> int:
        """The partition count of ``topic``, created now if it does not exist."""
        return self._topics.setdefault(topic, self.partitions)

    def choose_partition(self, topic: str, key: bytes | None) -> int:
        """Where the producer's partitioner puts a record: a keyed one where the Java client
        would (murmur2), the others in turn."""
        count = self.ensure_topic(topic)
        if key is not None:
            return partition_for(key, count)
        return next(self._next_keyless.setdefault(topic, itertools.count())) % count

    def write(
        self,
        tp: TopicPartition,
        key: bytes | None,
        value: bytes | None,
        headers: Headers,
        timestamp_ms: int | None,
        transaction: _Transaction | None,
    ) -> ConsumerRecord:
        log = self._logs.setdefault(tp, [])
        record = ConsumerRecord(
            topic=tp.topic,
            partition=tp.partition,
            offset=len(log),
            timestamp=_now_ms() if timestamp_ms is None else int(timestamp_ms),
            timestamp_type=0,  # CreateTime
            key=key,
            value=value,
            checksum=None,
            serialized_key_size=-1 if key is None else len(key),
            serialized_value_size=-1 if value is None else len(value),
            headers=tuple(headers),
        )
        entry = _Entry(record, transaction)
        if transaction is not None:
            self.join(transaction)
            transaction.first.setdefault(tp, record.offset)
        log.append(entry)
        self._written.append(entry)
        self._wake()
        return record

    def join(self, transaction: _Transaction) -> None:
        """The transaction is under way at the broker (it wrote, or took offsets) from now:
        a producer taking its id over aborts it."""
        assert transaction.state == "open"
        held = self._open.setdefault(transaction.transactional_id, transaction)
        assert held is transaction, f"{transaction.transactional_id} has two transactions"

    def end_transaction(self, transaction: _Transaction, *, commit: bool) -> None:
        """Write the transaction's markers; on a commit, its offsets become the groups'."""
        assert transaction.state == "open"
        transaction.state = "committed" if commit else "aborted"
        self._open.pop(transaction.transactional_id, None)
        for tp in transaction.first:
            self._logs[tp].append(_Entry(None, transaction))
        if commit:
            for group_id, offsets in transaction.offsets.items():
                self.commit(group_id, offsets)
        self._wake()

    def init_producer_id(self, transactional_id: str) -> int:
        """Fence the id's previous producer (its open transaction is aborted); the new epoch."""
        previous = self._open.get(transactional_id)
        if previous is not None:
            self.end_transaction(previous, commit=False)
        epoch = self._epochs[transactional_id] = self._epochs.get(transactional_id, -1) + 1
        return epoch

    def epoch(self, transactional_id: str) -> int:
        return self._epochs[transactional_id]

    def commit(self, group_id: str, offsets: Mapping[TopicPartition, int]) -> None:
        self._groups.setdefault(group_id, {}).update(offsets)
        self._offset_commits.setdefault(group_id, []).append(dict(offsets))

    def end(self, tp: TopicPartition, isolation_level: Isolation) -> int:
        """The partition's end for a reader: the high watermark, or ``read_committed`` the
        last stable offset (the first offset of an open transaction)."""
        high = len(self._logs.get(tp, ()))
        if isolation_level == "read_uncommitted":
            return high
        firsts = [t.first[tp] for t in self._open.values() if tp in t.first]
        return min(firsts, default=high)

    def read(
        self, tp: TopicPartition, start: int, isolation_level: Isolation, limit: int | None
    ) -> tuple[list[ConsumerRecord], int]:
        """The records from ``start`` (at most ``limit``) and the position after them."""
        log = self._logs.get(tp, [])
        stop = self.end(tp, isolation_level)
        records: list[ConsumerRecord] = []
        offset = start
        while offset < stop and (limit is None or len(records) < limit):
            entry = log[offset]
            if entry.record is not None and self._readable(entry, isolation_level):
                records.append(entry.record)
            offset += 1
        return records, offset

    def offset_for_time(
        self, tp: TopicPartition, timestamp_ms: int, isolation_level: Isolation
    ) -> OffsetAndTimestamp | None:
        """The first record at or after ``timestamp_ms``, as ListOffsets finds it."""
        log = self._logs.get(tp, [])
        for entry in log[: self.end(tp, isolation_level)]:
            record = entry.record
            if record is not None and record.timestamp >= timestamp_ms:
                return OffsetAndTimestamp(record.offset, record.timestamp)
        return None

    async def changed(self, within: float) -> None:
        """Wait until something is written or a transaction ends, at most ``within`` s."""
        event = asyncio.Event()
        self._waiters.add(event)
        try:
            await asyncio.wait_for(event.wait(), within)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(event)

    def _wake(self) -> None:
        for event in self._waiters:
            event.set()

    @staticmethod
    def _readable(entry: _Entry, isolation_level: Isolation) -> bool:
        if isolation_level == "read_uncommitted" or entry.transaction is None:
            return True
        return entry.transaction.state == "committed"


def _tp(record: ConsumerRecord) -> TopicPartition:
    return TopicPartition(record.topic, record.partition)


# -- producers -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Appended:
    """What aiokafka's ``BatchBuilder.append`` returns: the record's place in the batch."""

    offset: int
    size: int
    timestamp: int | None


class FakeBatch:
    """aiokafka's ``BatchBuilder``: records for one ``send_batch``. Full at ``max_batch_size``
    bytes (the first record always fits, as in aiokafka) or at ``max_records`` records."""

    def __init__(self, *, max_batch_size: int, max_records: int | None) -> None:
        self.max_batch_size = max_batch_size
        self.max_records = max_records
        self.records: list[tuple[bytes | None, bytes | None, Headers, int | None]] = []
        self._size = _BATCH_OVERHEAD

    def append(
        self,
        *,
        timestamp: int | None,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> _Appended | None:
        """Add a record; None when the batch is full."""
        listed = list(headers or [])
        size = _record_size(key, value, listed)
        count = len(self.records)
        if count and (
            self._size + size > self.max_batch_size
            or (self.max_records is not None and count >= self.max_records)
        ):
            return None
        self.records.append((key, value, listed, timestamp))
        self._size += size
        return _Appended(count, size, timestamp)

    def record_count(self) -> int:
        return len(self.records)

    def size(self) -> int:
        return self._size


class FakeProducer:
    """aiokafka's ``AIOKafkaProducer`` (without a transactional id) over a :class:`FakeKafka`.

    Args:
        max_batch_size: bytes a batch holds (aiokafka's default).
        max_batch_records: records a batch holds; None: as many as fit in its bytes.
        max_request_size: the largest record (or batch) a send takes (aiokafka's default).

    Knobs and records of what it did, for tests:
        fail_sends: per topic, errors the next sends to it fail with (their futures), one
            each, in order; the records of a failed send are not written.
        journal: what it did, in order (:data:`JournalEntry`).
        batches: (topic, partition, records) of each ``send_batch``.
    """

    def __init__(
        self,
        kafka: FakeKafka,
        *,
        max_batch_size: int = 16384,
        max_batch_records: int | None = None,
        max_request_size: int = 1048576,
    ) -> None:
        self.kafka = kafka
        self.max_batch_size = max_batch_size
        self.max_batch_records = max_batch_records
        self.max_request_size = max_request_size
        self.fail_sends: dict[str, list[BaseException]] = {}
        self.journal: list[JournalEntry] = []
        self.batches: list[tuple[str, int, int]] = []
        self.started = False
        self.stopped = False
        self._in_flight: set[asyncio.Future[RecordMetadata]] = set()

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True
        self.journal.append(("stop", "", None))

    async def partitions_for(self, topic: str) -> set[int]:
        return set(range(self.kafka.ensure_topic(topic)))

    def create_batch(self) -> FakeBatch:
        return FakeBatch(max_batch_size=self.max_batch_size, max_records=self.max_batch_records)

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        *,
        timestamp_ms: int | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Send one record; the future resolves to where it landed."""
        assert not (value is None and key is None), "Need at least one: key or value"
        self._may_send()
        listed = list(headers or [])
        size = _record_size(key, value, listed)
        if size > self.max_request_size:
            raise MessageSizeTooLargeError(
                f"The message is {size} bytes when serialized which is larger than the "
                "maximum request size you have configured with the max_request_size "
                "configuration"
            )
        partition = self._partition(topic, partition, key)
        return self._dispatch(
            TopicPartition(topic, partition), [(key, value, listed, timestamp_ms)]
        )

    async def send_and_wait(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        *,
        timestamp_ms: int | None = None,
    ) -> RecordMetadata:
        future = await self.send(topic, value, key, partition, headers, timestamp_ms=timestamp_ms)
        return await future

    async def send_batch(
        self, batch: FakeBatch, topic: str, *, partition: int
    ) -> asyncio.Future[RecordMetadata]:
        """Send a batch; the future resolves to where its first record landed."""
        partition = self._partition(topic, partition, None)
        self._may_send()
        self.batches.append((topic, partition, batch.record_count()))
        too_large = batch.size() > self.max_request_size
        error = MessageSizeTooLargeError("the batch is larger than the broker takes")
        return self._dispatch(
            TopicPartition(topic, partition), list(batch.records), error if too_large else None
        )

    # -- internals ------------------------------------------------------------------------

    def _may_send(self) -> None:
        """Raise if this producer may not send now (a transactional one overrides it)."""

    def _refusal(self) -> BaseException | None:
        """The broker's error for this producer's sends, if it refuses them."""
        return None

    def _transaction(self) -> _Transaction | None:
        return None

    def _partition(self, topic: str, partition: int | None, key: bytes | None) -> int:
        count = self.kafka.ensure_topic(topic)
        if partition is None:
            return self.kafka.choose_partition(topic, key)
        assert 0 <= partition < count, "Unrecognized partition"
        return partition

    def _dispatch(
        self,
        tp: TopicPartition,
        records: list[tuple[bytes | None, bytes | None, Headers, int | None]],
        error: BaseException | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RecordMetadata] = loop.create_future()
        for key, _, _, _ in records:
            self.journal.append(("send", tp.topic, key))
        failures = self.fail_sends.get(tp.topic)
        if error is None and failures:
            error = failures.pop(0)
        transaction = self._transaction()
        self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)
        loop.call_soon(self._land, future, tp, records, error, transaction)
        return future

    def _land(
        self,
        future: asyncio.Future[RecordMetadata],
        tp: TopicPartition,
        records: list[tuple[bytes | None, bytes | None, Headers, int | None]],
        error: BaseException | None,
        transaction: _Transaction | None,
    ) -> None:
        """The broker's answer, one loop turn after the send: write, then acknowledge."""
        if error is None:
            error = self._refusal()
        if error is not None:
            for key, _, _, _ in records:
                self.journal.append(("error", tp.topic, key))
            if transaction is not None and transaction.failed is None:
                transaction.failed = error
            if not future.done():
                future.set_exception(error)
            return
        first: ConsumerRecord | None = None
        for key, value, headers, timestamp_ms in records:
            record = self.kafka.write(tp, key, value, headers, timestamp_ms, transaction)
            first = first or record
            self.journal.append(("ack", tp.topic, key))
        assert first is not None, "an empty batch"
        if not future.done():  # a cancelled future does not stop the send (as in aiokafka)
            future.set_result(
                RecordMetadata(tp.topic, tp.partition, tp, first.offset, first.timestamp, 0, 0)
            )

    async def _landed(self) -> None:
        """Wait until every send made so far has been answered."""
        if self._in_flight:
            await asyncio.wait(list(self._in_flight))


class FakeTransactionalProducer(FakeProducer):
    """aiokafka's ``AIOKafkaProducer`` with a ``transactional_id``: sends only inside a
    transaction; ``start()`` fences the id's previous producer (see the module docstring).

    Knobs, for tests (besides :class:`FakeProducer`'s):
        begin_gate: when given, ``begin_transaction`` waits for it (a broker still completing
            the previous transaction).
        commit_gate: when given, ``commit_transaction`` waits for it (a commit in flight);
            ``committing`` is set once a commit has begun.
        fail_commits: errors the next commits fail with, one each (the transaction stays
            open, to be aborted).
        fail_offsets: errors the next offset commits fail with, one each, as the group
            coordinator refuses a zombie's (the transaction stays open, to be aborted).
    """

    def __init__(self, kafka: FakeKafka, transactional_id: str, **options: Any) -> None:
        super().__init__(kafka, **options)
        self.transactional_id = transactional_id
        self.begin_gate: asyncio.Event | None = None
        self.commit_gate: asyncio.Event | None = None
        self.committing = asyncio.Event()
        self.fail_commits: list[BaseException] = []
        self.fail_offsets: list[BaseException] = []
        self._epoch: int | None = None
        self._open: _Transaction | None = None

    @property
    def commits(self) -> int:
        """Transactions committed."""
        return sum(1 for kind, _, _ in self.journal if kind == "commit")

    @property
    def aborts(self) -> int:
        """Transactions aborted."""
        return sum(1 for kind, _, _ in self.journal if kind == "abort")

    async def start(self) -> None:
        """InitProducerId: take the transactional id over, fencing its previous producer."""
        await super().start()
        self._epoch = self.kafka.init_producer_id(self.transactional_id)

    async def begin_transaction(self) -> None:
        """Begin one (in the client alone, as aiokafka does: a fenced producer learns it at
        its first send, offsets or commit)."""
        self._started()
        if self.begin_gate is not None:
            await self.begin_gate.wait()
        if self._open is not None:
            raise IllegalStateError("a transaction is already open")
        self._open = _Transaction(self.transactional_id)
        self.journal.append(("begin", "", None))

    async def send_offsets_to_transaction(
        self, offsets: Mapping[TopicPartition, Any], group_id: str
    ) -> None:
        self._check_fenced()
        if self._open is None:
            raise IllegalOperation("Not in the middle of a transaction")
        if not group_id or not isinstance(group_id, str):
            raise ValueError(group_id)
        if self.fail_offsets:
            raise self.fail_offsets.pop(0)
        self._open.offsets.setdefault(group_id, {}).update(
            {tp: _offset_of(offset) for tp, offset in offsets.items()}
        )
        self.kafka.join(self._open)

    async def commit_transaction(self) -> None:
        transaction = self._current()
        self.committing.set()
        if self.commit_gate is not None:
            await self.commit_gate.wait()
        if self.fail_commits:
            raise self.fail_commits.pop(0)
        await self._landed()
        self._check_fenced()
        if transaction.failed is not None:
            raise transaction.failed
        self.kafka.end_transaction(transaction, commit=True)
        self._open = None
        self.journal.append(("commit", "", None))

    async def abort_transaction(self) -> None:
        transaction = self._current()
        await self._landed()
        self._check_fenced()
        self.kafka.end_transaction(transaction, commit=False)
        self._open = None
        self.journal.append(("abort", "", None))

    def _current(self) -> _Transaction:
        self._check_fenced()
        if self._open is None:
            raise IllegalStateError("no transaction is open")
        return self._open

    def _started(self) -> None:
        if self._epoch is None:
            raise IllegalStateError("start() the producer first: it has no producer id yet")

    def _refusal(self) -> BaseException | None:
        if self.kafka.epoch(self.transactional_id) == self._epoch:
            return None
        fenced: BaseException = ProducerFenced()
        return fenced

    def _check_fenced(self) -> None:
        self._started()
        error = self._refusal()
        if error is not None:
            raise error

    def _may_send(self) -> None:
        self._started()
        if self._open is None:
            raise IllegalOperation("Can't send messages while not in transaction")

    def _transaction(self) -> _Transaction | None:
        return self._open


def _offset_of(offset: Any) -> int:
    """An offset given as an int, an ``OffsetAndMetadata`` or an (offset, metadata) pair."""
    return offset if isinstance(offset, int) else int(offset[0])


async def fake_member_producer(
    kafka: FakeKafka, group_id: str, member: Callable[[], GroupMetadata], **options: Any
) -> tuple[MemberProducer, FakeTransactionalProducer]:
    """A started member producer in transactions, writing through a fake transactional
    producer over ``kafka`` (``options`` are the fake's); ``member()`` is its place in
    ``group_id``."""
    producer = MemberProducer(
        Settings(topic_prefix="p."),
        group_id=group_id,
        name="a",
        member=member,
        figures=MemberFigures(),
        transactions=True,
        transaction_timeout=10.0,
    )
    fake = FakeTransactionalProducer(kafka, producer.transactional_id, **options)
    await fake.start()
    producer._producers = [fake]  # the fake stands in for aiokafka's
    producer.transactional = True
    return producer, fake


# -- consumers -------------------------------------------------------------------------------


class FakeCluster:
    """aiokafka's ``ClusterMetadata``: the topics a client knows of (every topic, for a
    metadata request; else those it tracks)."""

    def __init__(self, kafka: FakeKafka, tracked: Iterable[str] | None) -> None:
        self._kafka = kafka
        self._tracked = None if tracked is None else set(tracked)

    def topics(self) -> set[str]:
        known = self._kafka.topics()
        return known if self._tracked is None else known & self._tracked

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        if self._tracked is not None and topic not in self._tracked:
            return None
        return self._kafka.partitions_of(topic)


class FakeClient:
    """aiokafka's ``AIOKafkaClient`` of a consumer: the topics whose metadata it tracks, and
    the cluster's metadata on request (``metadata_requests`` counts them)."""

    def __init__(self, kafka: FakeKafka) -> None:
        self.kafka = kafka
        self.topics: set[str] = set()
        self.metadata_requests = 0

    @property
    def cluster(self) -> FakeCluster:
        return FakeCluster(self.kafka, self.topics)

    async def set_topics(self, topics: Iterable[str]) -> None:
        self.topics = set(topics)

    async def fetch_all_metadata(self) -> FakeCluster:
        self.metadata_requests += 1
        return FakeCluster(self.kafka, None)


class FakeConsumer:
    """aiokafka's ``AIOKafkaConsumer``, assigned by hand, over a :class:`FakeKafka`.

    The defaults are those of ``deferline.topics.make_consumer``, which the code under test
    uses: ``read_committed``, ``auto_offset_reset="earliest"``.

    Knobs and records of what it did, for tests:
        on_stop: called at each ``stop()``.
        fetch_gate: when given, ``getmany`` takes its answer at the call and returns it once
            the gate is set (a fetch on its way).
        fetches: ``getmany`` calls so far.
    """

    def __init__(
        self,
        kafka: FakeKafka,
        *,
        group_id: str | None = None,
        isolation_level: Isolation = "read_committed",
        auto_offset_reset: Literal["earliest", "latest", "none"] = "earliest",
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self.kafka = kafka
        self.group_id = group_id
        self.isolation_level: Isolation = isolation_level
        self.auto_offset_reset = auto_offset_reset
        self.on_stop = on_stop
        self.fetch_gate: asyncio.Event | None = None
        self.fetches = 0
        self.started = False
        self.stopped = False
        self._client = FakeClient(kafka)
        self._positions: dict[TopicPartition, int | None] = {}  # None: to be reset
        self._paused: set[TopicPartition] = set()
        self._highwater: dict[TopicPartition, int] = {}

    @property
    def client(self) -> FakeClient:
        """The network client (``_client``, where deferline's ``client_of`` finds it)."""
        return self._client

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True
        if self.on_stop is not None:
            self.on_stop()

    # -- assignment -----------------------------------------------------------------------

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Replace the assignment; every position is forgotten, every pause lifted."""
        tps = list(partitions)
        self._positions = dict.fromkeys(tps)
        self._paused = set()
        self._highwater = {}
        self._client.topics = {tp.topic for tp in tps}

    def assignment(self) -> set[TopicPartition]:
        return set(self._positions)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        """From the metadata the client tracks: None for a topic it does not track."""
        return self._client.cluster.partitions_for_topic(topic)

    def pause(self, *partitions: TopicPartition) -> None:
        for tp in partitions:
            self._assigned(tp)
            self._paused.add(tp)

    def resume(self, *partitions: TopicPartition) -> None:
        for tp in partitions:
            self._assigned(tp)
            self._paused.discard(tp)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    # -- positions ------------------------------------------------------------------------

    def seek(self, partition: TopicPartition, offset: int) -> None:
        if not isinstance(offset, int) or offset < 0:
            raise ValueError("Offset must be a positive integer")
        self._assigned(partition)
        self._positions[partition] = offset

    async def seek_to_beginning(self, *partitions: TopicPartition) -> bool:
        for tp in partitions or tuple(self._positions):
            self._assigned(tp)
            self._positions[tp] = 0  # every log starts at 0: nothing is deleted here
        return True

    async def position(self, partition: TopicPartition) -> int:
        return self._position(partition)

    def highwater(self, partition: TopicPartition) -> int | None:
        """The partition's high watermark as of its last fetch (None before one)."""
        self._assigned(partition)
        return self._highwater.get(partition)

    async def beginning_offsets(
        self, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, int]:
        return dict.fromkeys(partitions, 0)

    async def end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.kafka.end(tp, self.isolation_level) for tp in partitions}

    async def offsets_for_times(
        self, timestamps: Mapping[TopicPartition, int]
    ) -> dict[TopicPartition, OffsetAndTimestamp | None]:
        for tp, ts in timestamps.items():
            if ts < 0:
                raise ValueError(f"The target time for partition {tp} is {ts}.")
        return {
            tp: self.kafka.offset_for_time(tp, ts, self.isolation_level)
            for tp, ts in timestamps.items()
        }

    # -- reading --------------------------------------------------------------------------

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[ConsumerRecord]]:
        """The records past the positions of the (given, else assigned) partitions that are
        not paused, at most ``max_records`` in all; waits up to ``timeout_ms`` for some."""
        if self.stopped:
            raise ConsumerStoppedError()
        if max_records is not None and (not isinstance(max_records, int) or max_records < 1):
            raise ValueError("`max_records` must be a positive Integer")
        self.fetches += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        while True:
            answer = self._fetch(partitions, max_records)
            left = deadline - loop.time()
            if answer or left <= 0:
                break
            await self.kafka.changed(left)
        if self.fetch_gate is not None:
            await self.fetch_gate.wait()
        else:
            await asyncio.sleep(0)  # a fetch yields, even with records at hand
        return answer

    def _fetch(
        self, partitions: Sequence[TopicPartition], max_records: int | None
    ) -> dict[TopicPartition, list[ConsumerRecord]]:
        answer: dict[TopicPartition, list[ConsumerRecord]] = {}
        left = max_records
        for tp in partitions or tuple(self._positions):
            if tp not in self._positions or tp in self._paused:
                continue
            records, after = self.kafka.read(tp, self._position(tp), self.isolation_level, left)
            self._positions[tp] = after
            self._highwater[tp] = self.kafka.end(tp, "read_uncommitted")
            if records:
                answer[tp] = records
                if left is not None:
                    left -= len(records)
                    if left == 0:
                        break
        return answer

    # -- the group's offsets --------------------------------------------------------------

    async def commit(self, offsets: Mapping[TopicPartition, Any] | None = None) -> None:
        """Commit ``offsets`` (by default, the positions) of assigned partitions."""
        group_id = self._group()
        if offsets is None:
            chosen = {tp: p for tp, p in self._positions.items() if p is not None}
        else:
            chosen = {tp: _offset_of(offset) for tp, offset in offsets.items()}
            for tp in chosen:
                if tp not in self._positions:
                    raise IllegalStateError(f"Partition {tp} is not assigned")
        self.kafka.commit(group_id, chosen)

    async def committed(self, partition: TopicPartition) -> int | None:
        return self.kafka.committed_offsets(self._group()).get(partition)

    # -- internals ------------------------------------------------------------------------

    def _group(self) -> str:
        if self.group_id is None:
            raise IllegalOperation("Requires group_id")
        return self.group_id

    def _assigned(self, tp: TopicPartition) -> None:
        if tp not in self._positions:
            raise IllegalStateError(f"No current assignment for partition {tp}")

    def _position(self, tp: TopicPartition) -> int:
        """The position of ``tp``, reset first if it has none (as aiokafka's fetcher does)."""
        self._assigned(tp)
        position = self._positions[tp]
        if position is None:
            committed = None
            if self.group_id is not None:
                committed = self.kafka.committed_offsets(self.group_id).get(tp)
            if committed is not None:
                position = committed
            elif self.auto_offset_reset == "earliest":
                position = 0
            elif self.auto_offset_reset == "latest":
                position = self.kafka.end(tp, self.isolation_level)
            else:
                raise NoOffsetForPartitionError(tp)
            self._positions[tp] = position
        return position
