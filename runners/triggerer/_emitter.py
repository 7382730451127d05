"""Batching producer pipeline: events first, tombstones only after their events are acked.

The supervisor's outcome callback is synchronous, so outcomes are queued here as
:class:`Emission` values. Two stages drain the queue in batches: stage one sends every
record of a batch (trigger events, direct-resume RunTasks, dead letters) and gathers the
acks together; stage two sends the tombstones of the emissions whose records were all
acked. Awaiting one send at a time would cap the rate at a few thousand per second; a
batch of sends shares the producer's linger window and one round trip. A failed send is
retried after a backoff; nothing is dropped while the emitter runs. A crash between the
two stages leaves the trigger in the defer table, so its next owner runs it again and
emits the same event id: a duplicate at worst, never a lost event.

The queue is bounded: once ``max_backlog`` emissions are outstanding, ``on_pressure(True)``
tells the source to stop submitting (the triggerer holds the supervisor's due timers), and
``on_pressure(False)`` follows once the backlog has drained to half of it. The bound is
soft, since ``submit`` never refuses (coroutine triggers and bad records may still add a
few), but a burst of due timers waits in the supervisor's heap, in order, not in here.

**Transactions.** An emission with an ``owner`` (the transactional id of its defer
partition, :meth:`Emitter.open`) goes through that partition's own transactional producer
instead: its records and its tombstone commit in one transaction, together with the rest
of the batch, so a reader in ``read_committed`` sees an event, its copies and its tombstone
all at once or not at all. A crash between them leaves nothing half written, and a paused
old owner is fenced by the new owner's producer (same transactional id): its transaction
is refused (``ProducerFenced``), its emissions are dropped, and ``on_fenced`` tells the
lane, whose partition it no longer is.

**Source offsets.** An emission read from a Kafka record (``source``, a standing watch's
:class:`~deferline.engine.SourcePosition`) commits the record's offset for its consumer group:
inside the transaction (``send_offsets_to_transaction``), or, without one, through
``source_offsets`` once the emission and every earlier one of its source partition are done.
Its trigger reads from those offsets when it starts again, so a record is read again only if
its event may not be out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from aiokafka import TopicPartition
from aiokafka.errors import (
    InvalidProducerEpoch,
    InvalidTopicError,
    MessageSizeTooLargeError,
    ProducerFenced,
    RecordListTooLargeError,
    RecordTooLargeError,
)
from deferline.engine import SourcePosition
from deferline.topics import trace_send

__all__ = ["Ack", "Emission", "Emitter", "Send", "TransactionalProducer"]

logger = logging.getLogger(__name__)

# A transaction of a producer whose transactional id another producer has taken over.
_FENCED: tuple[type[BaseException], ...] = (ProducerFenced, InvalidProducerEpoch)

# Errors that no retry can fix; everything else (timeouts, leader moves, a broker that is
# down) is retried until it succeeds.
_PERMANENT: tuple[type[BaseException], ...] = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    RecordListTooLargeError,
    InvalidTopicError,
    TypeError,
    ValueError,
)


class Producer(Protocol):
    """The part of :class:`aiokafka.AIOKafkaProducer` the emitter uses."""

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]: ...

    def create_batch(self) -> Any: ...

    async def send_batch(
        self, batch: Any, topic: str, *, partition: int
    ) -> asyncio.Future[Any]: ...


class TransactionalProducer(Producer, Protocol):
    """A started producer with a ``transactional_id``: what a partition's pipeline uses."""

    async def begin_transaction(self) -> None: ...

    async def commit_transaction(self) -> None: ...

    async def abort_transaction(self) -> None: ...

    async def send_offsets_to_transaction(
        self, offsets: dict[TopicPartition, int], group_id: str
    ) -> None: ...


class SourceCommits(Protocol):
    """Where the source offsets of emissions outside transactions go: each one submitted,
    then done (acked, or given up) (:class:`~._source_offsets.SourceOffsets`)."""

    def submitted(self, source: SourcePosition) -> None: ...

    def done(self, source: SourcePosition) -> None: ...


@dataclass(frozen=True, slots=True)
class Ack:
    """Where one record landed."""

    offset: int


@dataclass(slots=True)
class Send:
    """One record to produce; ``partition=None`` lets the producer's partitioner choose.

    Not frozen: two per fired trigger, and a frozen dataclass's ``__init__`` is several
    times slower. Nothing changes a Send once submitted."""

    topic: str
    key: bytes | None
    value: bytes | None
    partition: int | None = None


@dataclass(slots=True)
class Emission:
    """Records produced together, then an optional tombstone once all of them are acked.

    ``on_acked`` receives the record metadata of ``sends`` (same order) when they are all
    acked; ``on_done`` runs after the tombstone is acked (or right after ``on_acked`` when
    there is none). A send that fails with a permanent error (a record too large, for
    instance) is tried ``give_up_after`` times, then the emission is dropped and
    ``on_failed`` gets the error (the caller may submit a smaller replacement). Callbacks
    run on the event loop and must not block.
    """

    sends: Sequence[Send]
    tombstone: Send | None = None
    on_acked: Callable[[Sequence[Any]], None] | None = None
    on_done: Callable[[], None] | None = None
    on_failed: Callable[[BaseException], None] | None = None
    owner: str | None = None
    """The transactional id of the defer partition it belongs to (its records and tombstone
    then commit in one transaction, see :meth:`Emitter.open`); None: the two stages."""
    source: SourcePosition | None = None
    """The Kafka record it was read from: its offset is committed with it."""
    attempts: int = field(default=0)


@dataclass(eq=False)
class _Owner:
    """One defer partition's transactional pipeline: its producer, queue and task."""

    transactional_id: str
    producer: TransactionalProducer
    on_fenced: Callable[[str], None]
    queue: deque[Emission] = field(default_factory=deque)
    inflight: list[Emission] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    fenced: bool = False


class Emitter:
    """Drain emissions into the producer in batches (see the module docstring).

    Args:
        producer: a started producer (``send()`` returns the ack future).
        max_batch: emissions taken per stage round; bounds the memory of one round.
        retry_backoff: seconds to wait before retrying a batch whose sends failed.
        give_up_after: attempts before an emission failing with a permanent error (too
            large, invalid topic) is dropped and handed to its ``on_failed``; any other
            error is retried for as long as the emitter runs.
        max_backlog: outstanding emissions at which ``on_pressure(True)`` is called;
            ``on_pressure(False)`` follows once half of them are done. ``None``: unbounded.
        on_pressure: called with ``True`` when the backlog reaches ``max_backlog`` and with
            ``False`` when it has drained to half of it (on the loop, must not block).
        source_offsets: where the source offsets of emissions outside transactions are
            committed once they are acked (None: nowhere, their records are read again).
    """

    def __init__(
        self,
        producer: Producer,
        *,
        max_batch: int = 1000,
        retry_backoff: float = 0.5,
        give_up_after: int = 3,
        max_backlog: int | None = None,
        on_pressure: Callable[[bool], None] | None = None,
        source_offsets: SourceCommits | None = None,
    ) -> None:
        if max_backlog is not None and max_backlog < 1:
            raise ValueError(f"max_backlog must be at least 1, got {max_backlog}")
        self._producer = producer
        self._max_backlog = max_backlog
        self._low_water = 0 if max_backlog is None else max_backlog // 2
        self._on_pressure = on_pressure
        self._source_offsets = source_offsets
        self._full = False
        self.peak_backlog = 0
        """The largest backlog seen (the bound's effect, for tests and metrics)."""
        self._give_up_after = give_up_after
        self._max_batch = max_batch
        self._retry_backoff = retry_backoff
        self._first: deque[Emission] = deque()
        self._second: deque[Emission] = deque()
        self._first_ready = asyncio.Event()
        self._second_ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._outstanding = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._owners: dict[str, _Owner] = {}
        self.sent = 0
        self.failures = 0
        self.transactions = 0
        """Transactions committed by the partitions' pipelines."""

    @property
    def backlog(self) -> int:
        """Emissions submitted and not finished yet."""
        return self._outstanding

    @property
    def full(self) -> bool:
        """True from reaching ``max_backlog`` until the backlog drained to half of it."""
        return self._full

    def submit(self, emission: Emission) -> None:
        """Queue an emission (synchronous; safe to call from the supervisor's callback)."""
        self._outstanding += 1
        if self._outstanding > self.peak_backlog:
            self.peak_backlog = self._outstanding
        bound = self._max_backlog
        if bound is not None and not self._full and self._outstanding >= bound:
            self._set_full(True)
        self._idle.clear()
        if emission.source is not None and emission.owner is None and self._source_offsets:
            self._source_offsets.submitted(emission.source)
        if emission.owner is not None:
            owner = self._owners.get(emission.owner)
            if owner is None or owner.fenced:  # gone: its next owner runs the trigger again
                self._done()
            else:
                owner.queue.append(emission)
                owner.ready.set()
        elif emission.sends:
            self._first.append(emission)
            self._first_ready.set()
        else:
            self._second.append(emission)
            self._second_ready.set()

    def open(
        self,
        transactional_id: str,
        producer: TransactionalProducer,
        *,
        on_fenced: Callable[[str], None],
    ) -> None:
        """Write the emissions owned by ``transactional_id`` through ``producer`` (started,
        so the previous owner is fenced), in transactions. ``on_fenced(transactional_id)``
        runs once if another producer takes the id over (its emissions are then dropped)."""
        if transactional_id in self._owners:
            raise ValueError(f"{transactional_id} is already open")
        owner = _Owner(transactional_id, producer, on_fenced)
        owner.task = asyncio.create_task(self._transact(owner), name=f"emitter-{transactional_id}")
        self._owners[transactional_id] = owner

    async def close(self, transactional_id: str) -> TransactionalProducer | None:
        """Stop writing for ``transactional_id``: what it has not committed is dropped (the
        partition's next owner runs those triggers again). Returns its producer, for the
        caller to stop; None if it was not open."""
        owner = self._owners.pop(transactional_id, None)
        if owner is None:
            return None
        if owner.task is not None:
            owner.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await owner.task
        if owner.inflight and not owner.fenced:
            # Cut short mid-transaction: abort it rather than leave it open (readers in
            # read_committed would wait for it until the broker's transaction timeout).
            try:
                await asyncio.wait_for(owner.producer.abort_transaction(), 5.0)
            except Exception as exc:
                logger.warning(
                    "open transaction not aborted",
                    extra={"transactional_id": transactional_id, "error": repr(exc)},
                )
        self._drop(owner)
        return owner.producer

    async def start(self) -> None:
        """Start both stages."""
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._stage_one(), name="emitter-events"),
                asyncio.create_task(self._stage_two(), name="emitter-tombstones"),
            ]

    async def flush(self, within: float | None = None) -> bool:
        """Wait until everything submitted so far is acked; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), within)
        except TimeoutError:
            return False
        return True

    async def stop(self, within: float = 10.0) -> None:
        """Flush (bounded by ``within`` seconds), then stop the stages."""
        if not self._tasks:
            return
        if not await self.flush(within):
            logger.error(
                "emitter stopped with unsent records; their triggers stay in the defer "
                "table and run again on the next owner",
                extra={"backlog": self._outstanding},
            )
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for transactional_id in list(self._owners):
            await self.close(transactional_id)  # their producers are their lanes' to stop

    async def __aenter__(self) -> Emitter:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- stages ---------------------------------------------------------------------------

    def _take(self, queue: deque[Emission], ready: asyncio.Event) -> list[Emission]:
        batch: list[Emission] = []
        while queue and len(batch) < self._max_batch:
            batch.append(queue.popleft())
        if not queue:
            ready.clear()
        return batch

    def _set_full(self, full: bool) -> None:
        self._full = full
        if self._on_pressure is not None:
            try:
                self._on_pressure(full)
            except Exception:
                logger.exception("emitter pressure callback failed")

    def _done(self) -> None:
        """One emission left the emitter (acked or given up)."""
        self._outstanding -= 1
        if self._full and self._outstanding <= self._low_water:
            self._set_full(False)
        if self._outstanding == 0:
            self._idle.set()

    def _source_done(self, emission: Emission, source: SourcePosition) -> None:
        """An emission read from ``source`` left the emitter: outside transactions, its source
        offset may be committed once every earlier one of its partition is done too (in a
        transaction it is committed with the records)."""
        if emission.owner is None and self._source_offsets is not None:
            self._source_offsets.done(source)

    def _finish(self, emission: Emission) -> None:
        if emission.source is not None:
            self._source_done(emission, emission.source)
        if emission.on_done is not None:
            try:
                emission.on_done()
            except Exception:
                logger.exception("emission completion callback failed")
        self._done()

    async def _send_one(
        self, producer: Producer, send: Send
    ) -> asyncio.Future[Any] | BaseException:
        try:
            return await producer.send(
                send.topic,
                value=send.value,
                key=send.key,
                partition=send.partition,
                headers=trace_send(send.topic, send.value),
            )
        except Exception as exc:  # rejected before sending (e.g. record too large)
            return exc

    async def _send_all(self, producer: Producer, sends: list[Send]) -> list[Any]:
        """Send every record; one ack (or exception) per record, in order.

        Records with a partition are packed into one producer batch per topic-partition
        (one future per batch instead of one per record); the others go one by one.
        """
        results: list[Any] = [None] * len(sends)
        singles: list[tuple[int, asyncio.Future[Any] | BaseException]] = []
        batches: list[tuple[list[int], asyncio.Future[Any] | BaseException]] = []
        groups: dict[tuple[str, int], list[int]] = {}
        for index, send in enumerate(sends):
            if send.partition is None:
                singles.append((index, await self._send_one(producer, send)))
            else:
                groups.setdefault((send.topic, send.partition), []).append(index)
        for (topic, partition), indexes in groups.items():
            members: list[int] = []
            batch = producer.create_batch()
            for index in indexes:
                send = sends[index]
                headers = trace_send(topic, send.value)
                if (
                    batch.append(timestamp=None, key=send.key, value=send.value, headers=headers)
                    is None
                ):
                    if members:
                        batches.append(
                            (members, await self._submit(producer, batch, topic, partition))
                        )
                        batch, members = producer.create_batch(), []
                    if (
                        batch.append(
                            timestamp=None, key=send.key, value=send.value, headers=headers
                        )
                        is None
                    ):
                        singles.append((index, await self._send_one(producer, send)))
                        continue
                members.append(index)
            if members:
                batches.append((members, await self._submit(producer, batch, topic, partition)))
        waits = [f for _, f in singles if not isinstance(f, BaseException)]
        waits += [f for _, f in batches if not isinstance(f, BaseException)]
        await asyncio.gather(*waits, return_exceptions=True)
        for index, item in singles:
            results[index] = item if isinstance(item, BaseException) else _outcome(item)
        for members, item in batches:
            outcome = item if isinstance(item, BaseException) else _outcome(item)
            for position, index in enumerate(members):
                if isinstance(outcome, BaseException):
                    results[index] = outcome
                else:
                    results[index] = Ack(int(outcome.offset) + position)
        return results

    async def _submit(
        self, producer: Producer, batch: Any, topic: str, partition: int
    ) -> asyncio.Future[Any] | BaseException:
        try:
            return await producer.send_batch(batch, topic, partition=partition)
        except Exception as exc:
            return exc

    async def _stage_one(self) -> None:
        while True:
            await self._first_ready.wait()
            batch = self._take(self._first, self._first_ready)
            sends = [send for emission in batch for send in emission.sends]
            results = await self._send_all(self._producer, sends)
            retry: list[Emission] = []
            position = 0
            for emission in batch:
                mine = results[position : position + len(emission.sends)]
                position += len(emission.sends)
                errors = [r for r in mine if isinstance(r, BaseException)]
                if errors:
                    if self._note_failure(emission, errors[0]):
                        retry.append(emission)
                    continue
                self.sent += len(mine)
                if emission.on_acked is not None:
                    try:
                        emission.on_acked(mine)
                    except Exception:
                        logger.exception("emission ack callback failed")
                if emission.tombstone is None:
                    self._finish(emission)
                else:
                    self._second.append(emission)
                    self._second_ready.set()
            if retry:
                await asyncio.sleep(self._retry_backoff)
                self._first.extendleft(reversed(retry))
                self._first_ready.set()

    async def _stage_two(self) -> None:
        while True:
            await self._second_ready.wait()
            batch = self._take(self._second, self._second_ready)
            sends = [emission.tombstone for emission in batch if emission.tombstone is not None]
            results = await self._send_all(self._producer, sends)
            retry: list[Emission] = []
            position = 0
            for emission in batch:
                if emission.tombstone is None:
                    self._finish(emission)
                    continue
                result = results[position]
                position += 1
                if isinstance(result, BaseException):
                    if self._note_failure(emission, result):
                        retry.append(emission)
                else:
                    self.sent += 1
                    self._finish(emission)
            if retry:
                await asyncio.sleep(self._retry_backoff)
                self._second.extendleft(reversed(retry))
                self._second_ready.set()

    async def _transact(self, owner: _Owner) -> None:
        """One partition's pipeline: each batch's records and tombstones in one transaction;
        the callbacks run once it is committed. A batch whose transaction failed is aborted
        and sent again whole (an emission that failed for a reason no retry fixes, a record
        too large say, is given up as in the stages)."""
        while True:
            await owner.ready.wait()
            batch = owner.inflight = self._take(owner.queue, owner.ready)
            sends = [send for emission in batch for send in emission.sends]
            tombstones = [e.tombstone for e in batch if e.tombstone is not None]
            offsets = source_offsets(e.source for e in batch if e.source is not None)
            try:
                results = await self._in_transaction(owner.producer, [*sends, *tombstones], offsets)
            except _FENCED as exc:
                self._fenced(owner, exc)
                return
            if not any(isinstance(r, BaseException) for r in results):
                self.transactions += 1
                self.sent += len(results)
                position = 0
                for emission in batch:
                    mine = results[position : position + len(emission.sends)]
                    position += len(emission.sends)
                    if emission.on_acked is not None:
                        try:
                            emission.on_acked(mine)
                        except Exception:
                            logger.exception("emission ack callback failed")
                    self._finish(emission)
                owner.inflight = []
                continue
            retry: list[Emission] = []
            position, tombstone = 0, len(sends)
            for emission in batch:
                mine = results[position : position + len(emission.sends)]
                position += len(emission.sends)
                if emission.tombstone is not None:
                    mine.append(results[tombstone])
                    tombstone += 1
                error = next((r for r in mine if isinstance(r, BaseException)), None)
                if error is None or self._note_failure(emission, error):
                    retry.append(emission)  # aborted with the batch, or to try again
            owner.inflight = retry
            await asyncio.sleep(self._retry_backoff)
            owner.queue.extendleft(reversed(retry))
            owner.inflight = []
            if owner.queue:
                owner.ready.set()

    async def _in_transaction(
        self,
        producer: TransactionalProducer,
        sends: list[Send],
        offsets: dict[str, dict[TopicPartition, int]],
    ) -> list[Any]:
        """Send ``sends`` and commit ``offsets`` (per consumer group) in one transaction:
        their acks once it is committed; else (aborted) an exception for each record that
        failed, or for every record when the offsets or the commit did. Raises the fencing
        error when another producer holds the transactional id."""
        try:
            await producer.begin_transaction()
        except _FENCED:
            raise
        except Exception as exc:  # nothing begun, nothing to abort
            return [exc] * len(sends)
        results = await self._send_all(producer, sends)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is None:
            try:
                for group, group_offsets in offsets.items():
                    await producer.send_offsets_to_transaction(group_offsets, group)
                await producer.commit_transaction()
                return results
            except _FENCED:
                raise
            except Exception as exc:
                error = exc
                results = [exc] * len(sends)
        if isinstance(error, _FENCED):
            raise error
        try:
            await producer.abort_transaction()
        except _FENCED:
            raise
        except Exception as exc:
            logger.warning("aborting a failed transaction failed", extra={"error": repr(exc)})
        return results

    def _fenced(self, owner: _Owner, error: BaseException) -> None:
        """Another producer took the partition's transactional id over: drop what it holds."""
        owner.fenced = True
        logger.warning(
            "partition fenced: another member writes its events now; dropping its emissions",
            extra={"transactional_id": owner.transactional_id, "error": repr(error)},
        )
        self._drop(owner)
        try:
            owner.on_fenced(owner.transactional_id)
        except Exception:
            logger.exception("fenced callback failed")

    def _drop(self, owner: _Owner) -> None:
        """Forget the emissions of a closed or fenced partition (their triggers stay in the
        defer table: its next owner runs them again)."""
        for _ in range(len(owner.queue) + len(owner.inflight)):
            self._done()
        owner.queue.clear()
        owner.inflight = []

    def _note_failure(self, emission: Emission, error: BaseException) -> bool:
        """Count a failed attempt; True to retry, False when the emission was given up."""
        emission.attempts += 1
        self.failures += 1
        if isinstance(error, _PERMANENT) and emission.attempts >= self._give_up_after:
            logger.error(
                "produce failed permanently; giving the emission up",
                extra={"error": repr(error), "attempts": emission.attempts},
            )
            if emission.on_failed is not None:
                try:
                    emission.on_failed(error)
                except Exception:
                    logger.exception("emission failure callback failed")
            if emission.source is not None:  # its replacement (on_failed) stands for it
                self._source_done(emission, emission.source)
            self._done()
            return False
        level = logging.WARNING if emission.attempts < 5 else logging.ERROR
        logger.log(
            level,
            "produce failed; retrying",
            extra={"error": repr(error), "attempts": emission.attempts},
        )
        return True


def source_offsets(sources: Iterable[SourcePosition]) -> dict[str, dict[TopicPartition, int]]:
    """The offsets to commit per consumer group for records ``sources``: each partition's
    highest offset + 1."""
    offsets: dict[str, dict[TopicPartition, int]] = {}
    for source in sources:
        group = offsets.setdefault(source.group, {})
        tp = TopicPartition(source.topic, source.partition)
        if source.offset + 1 > group.get(tp, -1):
            group[tp] = source.offset + 1
    return offsets


def _outcome(future: asyncio.Future[Any]) -> Any:
    """A finished future's result, or its exception."""
    error = future.exception()
    return error if error is not None else future.result()
