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

**Transactions.** An emission with an ``owner`` (the transactional id of its lane's member
producer, :meth:`Emitter.open`) goes through that producer instead, in *rounds*: one
transaction per batch of the lane's emissions, whatever their partitions, holding their
records, their tombstones and the read offset of each defer partition they are for,
committed for the lane's group with the member's generation (KIP-447; see
:class:`~deferline.runners.member.MemberProducer`). A reader in ``read_committed`` sees an
event, its copies and its tombstone all at once or not at all, and a paused old owner's
round is refused by the group (:class:`~deferline.runners.member.MemberFenced`): its
emissions are dropped, and ``on_fenced`` tells the lane, which has lost its partitions.
Since every round carries the offsets of the partitions it writes, a new owner that reads
them ``require_stable`` never reads a partition past an old owner's open round. An emission
whose partition the lane no longer owns (``offset_of`` says None) is dropped from the next
round: its new owner runs the trigger again.

**Source offsets.** An emission read from a Kafka record (``source``, a standing watch's
:class:`~deferline.engine.SourcePosition`) commits the record's offset for its consumer group:
inside the round (as a standalone reader of that group), or, without one, through
``source_offsets`` once the emission and every earlier one of its source partition are done.
Its trigger reads from those offsets when it starts again, so a record is read again only if
its event may not be out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from aiokafka import TopicPartition
from aiokafka.errors import (
    InvalidTopicError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)
from deferline.engine import SourcePosition
from deferline.topics import trace_send

from ..member import MemberFenced, Placed

__all__ = ["Ack", "Emission", "Emitter", "RoundWriter", "Send"]

logger = logging.getLogger(__name__)

_ROUND_BATCHES = 10
"""A round takes at most this many ``max_batch`` of a lane's emissions."""

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


class RoundWriter(Protocol):
    """A lane's member producer, as its pipeline writes through it
    (:class:`~deferline.runners.member.MemberProducer`)."""

    async def write_placed(
        self,
        records: Sequence[Placed],
        offsets: Mapping[TopicPartition, int],
        *,
        foreign: Mapping[str, Mapping[TopicPartition, int]] | None = None,
    ) -> list[int]: ...


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
    """The transactional id of its lane's member producer (its records and tombstone then
    commit in one round, see :meth:`Emitter.open`); None: the two stages."""
    at: TopicPartition | None = None
    """The defer partition it is for: its read offset goes into the round with it."""
    source: SourcePosition | None = None
    """The Kafka record it was read from: its offset is committed with it."""
    attempts: int = field(default=0)


@dataclass(eq=False)
class _Pipeline:
    """One lane's rounds: its member producer, its queue and task."""

    transactional_id: str
    writer: RoundWriter
    offset_of: Callable[[TopicPartition], int | None]
    on_fenced: Callable[[], None]
    queue: deque[Emission] = field(default_factory=deque)
    inflight: list[Emission] = field(default_factory=list)
    """The round under way (or waiting to be retried)."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    solo: int = 0
    """Rounds still to take one emission each: a round failed whole for a reason no retry
    fixes, and the emission it was for is not known (the broker refused a batch)."""


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
        self._pipelines: dict[str, _Pipeline] = {}
        self.sent = 0
        self.failures = 0

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
            pipeline = self._pipelines.get(emission.owner)
            if pipeline is None:  # closed: the partition's next owner runs the trigger again
                self._done()
            else:
                pipeline.queue.append(emission)
                pipeline.ready.set()
        elif emission.sends:
            self._first.append(emission)
            self._first_ready.set()
        else:
            self._second.append(emission)
            self._second_ready.set()

    def open(
        self,
        transactional_id: str,
        writer: RoundWriter,
        *,
        offset_of: Callable[[TopicPartition], int | None],
        on_fenced: Callable[[], None],
    ) -> None:
        """Write the emissions owned by ``transactional_id`` through ``writer`` (a started
        member producer), in rounds. ``offset_of(tp)`` gives the read offset of a defer
        partition to commit with its records (None: no longer owned, its emissions are
        dropped); ``on_fenced()`` runs when the group refused a round (the member has lost
        its partitions; the round's emissions and those queued are dropped)."""
        if transactional_id in self._pipelines:
            raise ValueError(f"{transactional_id} is already open")
        pipeline = _Pipeline(transactional_id, writer, offset_of, on_fenced)
        pipeline.task = asyncio.create_task(
            self._rounds(pipeline), name=f"emitter-{transactional_id}"
        )
        self._pipelines[transactional_id] = pipeline

    async def close(self, transactional_id: str) -> None:
        """Stop writing for ``transactional_id``: what it has not committed is dropped (the
        partitions' next owners run those triggers again; a round still open is the member
        producer's to abort when it stops)."""
        pipeline = self._pipelines.pop(transactional_id, None)
        if pipeline is None:
            return
        if pipeline.task is not None:
            pipeline.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pipeline.task
        self._drop(pipeline)

    def discard(self, transactional_id: str, partitions: Iterable[TopicPartition]) -> None:
        """Drop the queued emissions of ``partitions`` (lost: their next owner runs those
        triggers again). A round already under way is the group's to decide: a new owner
        waits for it before reading the partition."""
        pipeline = self._pipelines.get(transactional_id)
        if pipeline is None:
            return
        gone = set(partitions)
        kept = deque(e for e in pipeline.queue if e.at not in gone)
        for _ in range(len(pipeline.queue) - len(kept)):
            self._done()
        pipeline.queue = kept
        if not kept:
            pipeline.ready.clear()

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
        for transactional_id in list(self._pipelines):
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

    def _take(
        self, queue: deque[Emission], ready: asyncio.Event, limit: int | None = None
    ) -> list[Emission]:
        limit = self._max_batch if limit is None else limit
        batch: list[Emission] = []
        while queue and len(batch) < limit:
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

    async def _rounds(self, pipeline: _Pipeline) -> None:
        """One lane's rounds, one after another: whatever is queued, written in one
        transaction with the read offsets of its partitions; the callbacks run once it is
        committed. A round that failed was aborted and its emissions are sent again (one
        that failed for a reason no retry fixes, a record too large say, is given up as in
        the stages)."""
        while True:
            await pipeline.ready.wait()
            if pipeline.solo:
                pipeline.solo -= 1
                batch = self._take(pipeline.queue, pipeline.ready, 1)
            else:
                # Bounded, so a round stays well inside its transaction timeout (the session
                # timeout) however deep the backlog.
                batch = self._take(pipeline.queue, pipeline.ready, _ROUND_BATCHES * self._max_batch)
            offsets: dict[TopicPartition, int] = {}
            write: list[Emission] = []
            for emission in batch:
                if (at := emission.at) is not None and at not in offsets:
                    offset = pipeline.offset_of(at)
                    if offset is None:  # lost: its next owner runs the trigger again
                        self._done()
                        continue
                    offsets[at] = offset
                write.append(emission)
            if not write:
                continue
            pipeline.inflight = write
            records: list[Placed] = [
                (send.topic, send.key, send.value, send.partition)
                for emission in write
                for send in emission.sends
            ]
            records += [
                (t.topic, t.key, t.value, t.partition)
                for emission in write
                if (t := emission.tombstone) is not None
            ]
            foreign = source_offsets(e.source for e in write if e.source is not None)
            try:
                acked = await pipeline.writer.write_placed(records, offsets, foreign=foreign)
            except MemberFenced as exc:
                self._fenced(pipeline, exc)
                continue
            except Exception as exc:
                error: BaseException | None = exc
                if isinstance(exc, _PERMANENT) and len(write) > 1:
                    # One of them cannot be written: each goes alone until it is found,
                    # its round mates counting no failure meanwhile.
                    pipeline.solo = len(write)
                    error = None
            else:
                pipeline.inflight = []
                self._committed(write, acked)
                continue
            retry = [  # aborted with the round, or to try again
                emission
                for emission in write
                if error is None or self._note_failure(emission, error)
            ]
            pipeline.inflight = retry
            await asyncio.sleep(self._retry_backoff)
            pipeline.queue.extendleft(reversed(retry))
            pipeline.inflight = []
            if pipeline.queue:
                pipeline.ready.set()

    def _committed(self, write: list[Emission], acked: list[int]) -> None:
        """A round committed: its emissions are done, each told where its records landed."""
        offsets = [Ack(offset) for offset in acked]
        self.sent += len(offsets)
        position = 0
        for emission in write:
            mine = offsets[position : position + len(emission.sends)]
            position += len(emission.sends)
            if emission.on_acked is not None:
                try:
                    emission.on_acked(mine)
                except Exception:
                    logger.exception("emission ack callback failed")
            self._finish(emission)

    def _fenced(self, pipeline: _Pipeline, error: BaseException) -> None:
        """The group refused a round: the member has lost its partitions. What the round
        and the queue hold is dropped (the partitions' next owners run those triggers)."""
        logger.warning(
            "round fenced by the group: this member lost its partitions; dropping its emissions",
            extra={"transactional_id": pipeline.transactional_id, "error": repr(error)},
        )
        self._drop(pipeline)
        try:
            pipeline.on_fenced()
        except Exception:
            logger.exception("fenced callback failed")

    def _drop(self, pipeline: _Pipeline) -> None:
        """Forget the emissions of a closed or fenced pipeline, queued or under way."""
        for _ in range(len(pipeline.queue) + len(pipeline.inflight)):
            self._done()
        pipeline.queue.clear()
        pipeline.inflight = []

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
