"""One member's producer: every partition the member owns writes through it, and on Apache
Kafka exactly once, in one transaction per round for all of them (KIP-447).

**With transactions** (Apache Kafka 2.5+) the member has transactional ids of its own
(``<group>.member.<name>.0`` and ``.1``), not one per partition. Batches handed to it
(:meth:`MemberProducer.write`, :meth:`MemberProducer.write_placed`) are written in *rounds*:
a round is one transaction holding every batch handed over since the round before,
whichever partitions they are for, and the consumed offsets those batches carry, committed
for the group with the member's generation and member id (TxnOffsetCommit v3). Rounds run
back to back: one starts as soon as the one before it has ended, so under load a round is as
large as the rounds' pace makes it, and a lone batch waits for no timer (Kafka Streams
commits every 100 ms under exactly once; a resumed task here waits for none of that).

The two producers take the rounds in turn. A producer's next transaction is refused
(CONCURRENT_TRANSACTIONS) while the broker still writes the markers of its last one, and
aiokafka then waits 20 ms before asking again: with one producer, a round that followed
another closely waited that long (docs/history/2026-12-07.md). Rounds are still one at a
time, so they commit in the order they were handed over.

- *A zombie is fenced by the group.* A member the group went on without (paused past its
  session, then woken) sends offsets for a generation that is over: the coordinator refuses
  them, the whole round is aborted (every partition's records in it), and each batch's
  writer gets :class:`MemberFenced`.
- *A new owner waits for the old owner's open round.* It reads a partition's committed
  offsets with :meth:`MemberProducer.committed` (OffsetFetch ``require_stable``), which
  waits while a transaction still holds them. So every batch must carry an offset for its
  partition (its last committed one, if nothing moved): then no round can write a
  partition's records without also holding its offsets until it ends.
- *What it costs.* A member killed with a round open leaves it open until the broker times
  it out (``transaction.timeout.ms``, set to the group's session timeout, found by the
  broker every ``transaction.abort.timed.out.transaction.cleanup.interval.ms``): the new
  owner of its partitions waits that long, and ``read_committed`` readers of the topics it
  wrote see nothing past its records meanwhile. With one transactional id per partition the
  new owner aborted it at once; the price of that was a producer, a sender and a transaction
  per partition and round.

**Without transactions** (Tansu, ``--transactions off``, brokers before 2.5) the same one
producer writes each batch's waves in order, each acknowledged before the next; offsets are
committed by the member's consumer, and nothing fences a zombie.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    CoordinatorLoadInProgressError,
    CoordinatorNotAvailableError,
    IncompatibleBrokerVersion,
    KafkaError,
    NotCoordinatorError,
    ProducerFenced,
    UnknownError,
    UnsupportedVersionError,
)
from deferline.schemas import DeferlineError
from deferline.topics import (
    Murmur2Partitioner,
    Settings,
    make_producer,
    partition_for,
    start_client,
    stop_client,
    trace_send,
    tracing_on,
)

from .._aiokafka import (
    FencedByGroup,
    GroupMetadata,
    UnstableOffsets,
    abort_reaches_the_broker,
    commit_offsets_with_generation,
    fetch_stable_offsets,
    offsets_of_several_groups,
)
from ._figures import MemberFigures

__all__ = [
    "MemberFenced",
    "MemberProducer",
    "MemberProducerError",
    "Outgoing",
    "Placed",
]

logger = logging.getLogger(__name__)

Outgoing = tuple[str, bytes | None, bytes | None]  # topic, key, value (None: a tombstone)
"""A record to write: its partition is its key's (murmur2), as every client of the topics
computes it."""

Placed = tuple[str, bytes | None, bytes | None, int | None]  # topic, key, value, partition
"""A record to write to the partition it names (a defer partition's tombstone, say: it goes
where the record it deletes is, whatever client wrote that); None: its key's."""


_Records = list[bytes | None]
"""One partition's records in a round, flat: key, value, key, value, and so on (no tuple per
record)."""

_NO_HEADERS: list[tuple[str, bytes]] = []  # an untraced record's (never changed)
_NO_MEMBER = GroupMetadata(group_id="", generation=-1, member_id="")
_STABLE_POLL = 0.02  # seconds between asks for offsets a transaction holds
_COORDINATOR_MOVING = (
    CoordinatorNotAvailableError,
    NotCoordinatorError,
    CoordinatorLoadInProgressError,
)


def _group(groups: dict[str, dict[int, _Records]], topic: str, partition: int) -> _Records:
    """The records of ``topic``'s ``partition`` in ``groups``, a new list the first time."""
    parts = groups.get(topic)
    if parts is None:
        parts = groups[topic] = {}
    records = parts.get(partition)
    if records is None:
        records = parts[partition] = []
    return records


class MemberFenced(DeferlineError):
    """The group went on without this member: the round holding the batch was aborted."""


class MemberProducerError(DeferlineError):
    """The member's producer cannot go on (another process took its transactional id, the
    broker lacks what ``transactions=True`` asked for)."""


class MemberProducer:
    """The member's one producer (see the module's docstring).

    Args:
        settings: connection settings.
        group_id: the member's consumer group (its offsets go into the rounds).
        name: this member's name, unique to this process (drawn at its start): a process
            taking the same transactional id over would fence this one.
        member: the member's place in the group, read at each round's offset commit.
        figures: the member's figures; its rounds, committed and fenced, are counted there.
        transactions: write in transactions (True: a broker without KIP-447 is an error),
            never (False), or when the broker has them (None).
        transaction_timeout: seconds before the broker aborts an open round of a member that
            died (the group's session timeout: a dead member holds its partitions no longer
            than the group takes to notice).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        group_id: str,
        name: str,
        member: Callable[[], GroupMetadata],
        figures: MemberFigures,
        transactions: bool | None,
        transaction_timeout: float,
    ) -> None:
        self.settings = settings
        self.group_id = group_id
        self.transactional_id = f"{group_id}.member.{name}"
        self.transactional: bool | None = None  # known once started
        self.figures = figures
        self._member = member
        self._transactions = transactions
        self._timeout_ms = max(1000, int(transaction_timeout * 1000))
        self._producers: list[AIOKafkaProducer] = []  # two in transactions, taking turns
        self._partitioner = Murmur2Partitioner()
        self._queue: list[_Batch] = []
        self._round: asyncio.Task[None] | None = None
        self._turn = 0  # the producer the next round is on
        self._renew: set[int] = set()  # fenced by the broker: new ones for their next rounds
        self._round_member = _NO_MEMBER  # the member's place, as the open round commits it

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect; with ``transactions`` None, write in transactions if the broker has them
        and KIP-447 (found out here, once)."""
        if self._transactions is not False and await self._start_transactional():
            self.transactional = True
            return
        self.transactional = False
        producer = make_producer(self.settings, linger_ms=0, max_batch_size=1 << 20)
        self._producers = [producer]
        await start_client(producer, grace=5.0, name="member producer")

    def _transactional_producer(self, turn: int) -> AIOKafkaProducer:
        producer = make_producer(
            self.settings,
            transactional_id=f"{self.transactional_id}.{turn}",
            transaction_timeout_ms=self._timeout_ms,
            enable_idempotence=True,
            # Batches are handed over whole (send_batch): lingering only delays the round.
            linger_ms=0,
            max_batch_size=1 << 20,
            # The broker answers CONCURRENT_TRANSACTIONS while it writes the markers of the
            # producer's previous round; aiokafka then waits this long before asking again
            # (100 ms by default; 20 ms for AddPartitionsToTxn, as the Java client).
            retry_backoff_ms=5,
        )
        abort_reaches_the_broker(producer)
        offsets_of_several_groups(producer)  # a watch's source group beside the member's
        commit_offsets_with_generation(producer, lambda: self._round_member)
        return producer

    async def _start_transactional(self) -> bool:
        producer = self._transactional_producer(0)
        self._producers = [producer]  # stop() closes it
        try:
            await start_client(producer, grace=5.0, name="member producer")
            self.transactional = True
            # OffsetFetch v7 (require_stable) is KIP-447's too: a broker that has it takes
            # TxnOffsetCommit v3.
            await self.committed([])
        except (UnknownError, UnsupportedVersionError, IncompatibleBrokerVersion) as exc:
            self._producers = []
            self.transactional = None
            await stop_client(producer, grace=5.0, name="member producer")
            if self._transactions:
                raise MemberProducerError(
                    f"the broker has no transactions with group fencing (KIP-447, Apache Kafka "
                    f"2.5+): {type(exc).__name__}: {exc}"
                ) from exc
            logger.warning(
                "broker has no transactions with group fencing (KIP-447): writing at least "
                "once; a paused old owner is not fenced",
                extra={"transactional_id": self.transactional_id},
            )
            return False
        other = self._transactional_producer(1)
        self._producers.append(other)
        await start_client(other, grace=5.0, name="member producer")
        return True

    async def stop(self) -> None:
        """Close the producers (bounded: the broker may be gone). An open round is aborted by
        the broker; its writers get an error."""
        producers, self._producers = self._producers, []
        if self._round is not None and not self._round.done():
            self._round.cancel()
            await asyncio.wait({self._round})
        self._fail(self._queue, MemberProducerError(f"{self.transactional_id} stopped"))
        self._queue = []
        for producer in producers:
            await stop_client(producer, grace=5.0, name="member producer")

    # -- writing ----------------------------------------------------------------------------

    async def write(
        self, waves: Sequence[Sequence[Outgoing]], offsets: Mapping[TopicPartition, int]
    ) -> None:
        """Write ``waves`` in order (and, in transactions, commit ``offsets`` for the group
        with them): returns once they are acknowledged, in transactions once their round
        committed. Raises :class:`MemberFenced` when the group refused the round, the broker's
        error otherwise. Concurrent writes share rounds."""
        if not self._producers:
            raise MemberProducerError(f"{self.transactional_id} is not started")
        if not self.transactional:
            chosen: dict[int, dict[bytes, int]] = {}
            for wave in waves:
                futures = await self._send(self._producers[0], wave, chosen)
                if futures:
                    await asyncio.gather(*futures)
            return
        await self._in_round(_Batch(waves, offsets))

    async def write_placed(
        self,
        records: Sequence[Placed],
        offsets: Mapping[TopicPartition, int],
        *,
        foreign: Mapping[str, Mapping[TopicPartition, int]] | None = None,
    ) -> list[int]:
        """Write ``records`` to the partitions they name in the next round, committing
        ``offsets`` for the group and ``foreign`` (other groups' offsets, as a standalone
        reader's) with them. Returns each record's offset once the round committed. Raises
        :class:`MemberFenced` when the group refused the round, the broker's error when it
        failed otherwise (a record larger than the broker takes fails its whole round). In
        transactions only."""
        if not self._producers or not self.transactional:
            raise MemberProducerError(f"{self.transactional_id} writes placed records in rounds")
        acked = await self._in_round(_Batch((), offsets, placed=records, foreign=foreign))
        assert acked is not None
        return acked

    async def _in_round(self, batch: _Batch) -> list[int] | None:
        """Hand ``batch`` to the next round (a round takes what is queued when it begins, so
        batches handed over together share it); its outcome once the round ended."""
        self._queue.append(batch)
        if self._round is None or self._round.done():
            self._round = asyncio.create_task(self._rounds(), name="member-rounds")
        return await asyncio.shield(batch.done)

    async def _rounds(self) -> None:
        """One transaction after another while batches wait, on the producers in turn."""
        while self._queue:
            batches, self._queue = self._queue, []
            turn = self._turn
            self._turn = (turn + 1) % len(self._producers)
            try:
                await self._one_round(await self._renewed(turn), batches, turn)
            except BaseException as exc:
                if isinstance(exc, FencedByGroup):
                    self.figures.round_fenced()
                self._fail(batches, exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
            else:
                for batch in batches:
                    batch.done.set_result(batch.acked())

    def _fail(self, batches: list[_Batch], exc: BaseException) -> None:
        for batch in batches:
            if not batch.done.done():
                batch.done.set_exception(_as_written(exc, self.transactional_id))
                batch.done.exception()  # a writer that went away does not warn

    async def _one_round(
        self, producer: AIOKafkaProducer, batches: list[_Batch], turn: int
    ) -> None:
        offsets: dict[TopicPartition, int] = {}
        foreign: dict[str, dict[TopicPartition, int]] = {}
        for batch in batches:
            offsets.update(batch.offsets)
            for group, theirs in (batch.foreign or {}).items():
                merged = foreign.setdefault(group, {})
                for tp, offset in theirs.items():
                    merged[tp] = max(offset, merged.get(tp, offset))
        member = self._member()
        if offsets and (member.generation < 0 or not member.member_id):
            # Between generations (its session expired, it is joining again): the
            # coordinator would take offsets of no generation as a non-member's, unfenced.
            raise FencedByGroup(
                f"not a member of {self.group_id} now (generation {member.generation})"
            )
        self._round_member = member  # one place for the whole round, as it was at its start
        await producer.begin_transaction()
        try:
            chosen: dict[int, dict[bytes, int]] = {}
            futures = [
                f
                for batch in batches
                for wave in batch.waves
                for f in await self._send(producer, wave, chosen)
            ]
            for batch in batches:
                if batch.placed is not None:
                    batch.placement = await self._send_placed(producer, batch.placed)
                    futures += batch.placement.sent
            if offsets:
                await producer.send_offsets_to_transaction(offsets, self.group_id)
            for group, theirs in foreign.items():
                await producer.send_offsets_to_transaction(theirs, group)
            await producer.commit_transaction()
        except ProducerFenced as exc:
            # The broker aborted the round and moved the id's epoch on: the transaction
            # timeout passed while it was open (the broker or this process stalled that
            # long). Its partitions may have moved on without it, as a zombie's.
            self._renew.add(turn)
            raise FencedByGroup(
                f"the broker aborted the round after its transaction timeout ({exc})"
            ) from exc
        except (KafkaError, FencedByGroup):
            await _abort(producer)
            raise
        await asyncio.gather(*futures)
        self.figures.round_committed()

    async def _renewed(self, turn: int) -> AIOKafkaProducer:
        """The producer of round ``turn``: a new one (same transactional id) after the
        broker fenced the last."""
        if not self._producers:
            raise MemberProducerError(f"{self.transactional_id} is stopped")
        producer = self._producers[turn]
        if turn in self._renew:
            await stop_client(producer, grace=5.0, name="member producer")
            producer = self._producers[turn] = self._transactional_producer(turn)
            await start_client(producer, grace=5.0, name="member producer")  # or next round
            self._renew.discard(turn)
            logger.info(
                "member producer started again after the broker fenced it",
                extra={"transactional_id": f"{self.transactional_id}.{turn}"},
            )
        return producer

    async def _send(
        self,
        producer: AIOKafkaProducer,
        wave: Sequence[Outgoing],
        chosen: dict[int, dict[bytes, int]],
    ) -> list[asyncio.Future[Any]]:
        """Queue one wave as one record batch per partition (far cheaper than a ``send`` per
        record); returns the futures of the batches.

        ``chosen`` keeps each key's partition index (per partition count) across the waves of
        one write: a task's state and its RunTask share the key, so it is hashed once."""
        groups: dict[str, dict[int, _Records]] = {}
        partitions: dict[str, tuple[list[int], dict[bytes, int]]] = {}
        for topic, key, value in wave:
            known = partitions.get(topic)
            if known is None:
                ids = sorted(await producer.partitions_for(topic))
                known = partitions[topic] = (ids, chosen.setdefault(len(ids), {}))
            ids, indexes = known
            if key is None:
                partition = self._partitioner(key, ids, ids)
            else:
                index = indexes.get(key)
                if index is None:
                    index = indexes[key] = partition_for(key, len(ids))
                partition = ids[index]
            records = _group(groups, topic, partition)
            records.append(key)
            records.append(value)
        futures: list[asyncio.Future[Any]] = []
        for topic, parts in groups.items():
            for partition, records in parts.items():
                futures += [
                    sent for sent, _ in await self._pack(producer, topic, partition, records)
                ]
        return futures

    async def _send_placed(
        self, producer: AIOKafkaProducer, records: Sequence[Placed]
    ) -> _Placement:
        """Queue placed records, one record batch per partition; where each went."""
        groups: dict[str, dict[int, _Records]] = {}
        order: list[_Records] = []  # per record, the records of its partition
        known: dict[str, list[int]] = {}  # a topic's partitions, asked once a call
        for topic, key, value, partition in records:
            if partition is None:
                ids = known.get(topic)
                if ids is None:
                    ids = known[topic] = sorted(await producer.partitions_for(topic))
                partition = (
                    self._partitioner(key, ids, ids)
                    if key is None
                    else ids[partition_for(key, len(ids))]
                )
            group = _group(groups, topic, partition)
            group.append(key)
            group.append(value)
            order.append(group)
        sent: list[asyncio.Future[Any]] = []
        spans: dict[int, list[tuple[int, int]]] = {}
        for topic, parts in groups.items():
            for partition, group in parts.items():
                batches = spans[id(group)] = []
                for batch, count in await self._pack(producer, topic, partition, group):
                    batches.append((len(sent), count))
                    sent.append(batch)
        return _Placement(sent, order, spans)

    async def _pack(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        partition: int,
        records: _Records,
    ) -> list[tuple[asyncio.Future[Any], int]]:
        """Queue ``records`` for one partition as few record batches as hold them; per batch,
        in order, its future and how many records it holds.

        A batch's first record always fits (aiokafka's builder takes it whatever its size),
        so a record larger than a batch goes alone; one larger than the broker takes fails
        the round with the broker's error."""
        traced = tracing_on()  # asked once a call, not per record
        sent: list[tuple[asyncio.Future[Any], int]] = []
        batch = producer.create_batch()
        pairs = iter(records)
        for key, value in zip(pairs, pairs, strict=True):
            headers = trace_send(topic, value) if traced else _NO_HEADERS
            if batch.append(key=key, value=value, timestamp=None, headers=headers) is not None:
                continue
            count = batch.record_count()  # full: send it, start the next
            sent.append((await producer.send_batch(batch, topic, partition=partition), count))
            batch = producer.create_batch()
            first = batch.append(key=key, value=value, timestamp=None, headers=headers)
            assert first is not None, "a record batch takes its first record"
        if count := batch.record_count():
            sent.append((await producer.send_batch(batch, topic, partition=partition), count))
        return sent

    # -- reading offsets --------------------------------------------------------------------

    async def committed(
        self, partitions: Sequence[TopicPartition]
    ) -> dict[TopicPartition, int | None]:
        """The group's committed offsets of ``partitions`` once no transaction holds them
        (a previous owner's round open, or its markers still being written): a new owner
        reads from there and never past what that round decides. In transactions only."""
        if not self._producers or not self.transactional:
            raise MemberProducerError("stable offsets are read through a transactional producer")
        producer = self._producers[0]
        began = last_said = time.monotonic()
        while True:
            try:
                return await fetch_stable_offsets(producer.client, self.group_id, partitions)
            except _COORDINATOR_MOVING:  # the group's coordinator is starting or moving
                await asyncio.sleep(_STABLE_POLL)
                continue
            except UnstableOffsets:
                now = time.monotonic()
                if now - last_said >= 5.0:
                    last_said = now
                    logger.warning(
                        "waiting for a previous owner's transaction to end before reading "
                        "its offsets (a member that died with one open: the broker aborts it "
                        "after its transaction timeout)",
                        extra={
                            "group_id": self.group_id,
                            "partitions": sorted(tp.partition for tp in partitions),
                            "waited_s": round(now - began, 1),
                        },
                    )
                await asyncio.sleep(_STABLE_POLL)


class _Placement:
    """Where a writer's placed records went, without an object per record (a round holds
    tens of thousands, and each object alive through it counts towards the collector's next
    pass, in a process that may hold millions): the futures of the record batches sent for
    them; per record, in the order handed over, the records of its partition
    (:data:`_Records`); and per partition, by the ``id`` of those records, its record
    batches in order: each one's index in ``sent`` and how many records it holds."""

    __slots__ = ("order", "sent", "spans")

    def __init__(
        self,
        sent: list[asyncio.Future[Any]],
        order: list[_Records],
        spans: dict[int, list[tuple[int, int]]],
    ) -> None:
        self.sent = sent
        self.order = order
        self.spans = spans

    def offsets(self) -> list[int]:
        """Each record's offset, in the order handed over, its round committed."""
        firsts = [int(batch.result().offset) for batch in self.sent]
        per_partition = {
            key: iter(
                [o for index, count in batches for o in range(firsts[index], firsts[index] + count)]
            )
            for key, batches in self.spans.items()
        }
        return [next(per_partition[id(records)]) for records in self.order]


class _Batch:
    """A writer's batch waiting for its round."""

    __slots__ = ("done", "foreign", "offsets", "placed", "placement", "waves")

    def __init__(
        self,
        waves: Sequence[Sequence[Outgoing]],
        offsets: Mapping[TopicPartition, int],
        *,
        placed: Sequence[Placed] | None = None,
        foreign: Mapping[str, Mapping[TopicPartition, int]] | None = None,
    ) -> None:
        self.waves = waves
        self.offsets = offsets
        self.placed = placed
        self.foreign = foreign
        self.done: asyncio.Future[list[int] | None] = asyncio.get_running_loop().create_future()
        self.placement: _Placement | None = None  # once its records are sent

    def acked(self) -> list[int] | None:
        """Its placed records' offsets, its round committed (None: it placed none)."""
        return None if self.placement is None else self.placement.offsets()


def _as_written(exc: BaseException, transactional_id: str) -> BaseException:
    """What a writer whose round failed gets."""
    if isinstance(exc, FencedByGroup):
        return MemberFenced(
            f"the group went on without this member: {transactional_id}'s round was aborted ({exc})"
        )
    if isinstance(exc, asyncio.CancelledError):
        return MemberProducerError(f"{transactional_id} stopped with the round open")
    return exc


async def _abort(producer: AIOKafkaProducer) -> None:
    """Abort the open round, if the producer still can (otherwise the broker times it out)."""
    try:
        await producer.abort_transaction()
    except KafkaError as exc:
        logger.warning("could not abort the member's transaction: %s", exc)
