"""One trigger queue of a triggerer: a consumer-group member on that queue's defer topic.

Partition assignment decides which triggers this member runs. For each newly assigned
partition the lane rebuilds the active set (checkpoint, then the defer tail up to the end
offset seen at assignment), drops triggers whose event is already on the co-partitioned
resume topic, follows the live tail again and starts the rest beside it (the latest record
per trigger id wins, whether it came from the fold or the tail).

Rebalances are incremental on top of the eager protocol (which revokes every partition on
every rebalance): a sticky assignor keeps partitions where they are, and on revocation the
lane only *quiesces* (stops emitting and applying records for the partitions, holds the
events their triggers produce, flushes what is in flight, checkpoints and commits) without
cancelling anything. The next assignment settles it: kept partitions resume at once (held
events emitted, triggers never stopped), lost ones are cancelled without emitting (their
new owner rebuilds and fires them), new ones are rebuilt.

:class:`TriggerLane` is a thin shell: it does the I/O (clients, tasks, the fetch loop) and
wires parts that each own their state. Who writes what:

===========================  ==========================================================
state                        written by
===========================  ==========================================================
``_parts`` (owned map)       :class:`TriggerLane` (assignment, loss, release)
a partition's phase, held    its :class:`~._partition_book.PartitionBook`, through its
outcomes, done keys          methods only (moved by the lane and the
                             :class:`~._rebuild.Rebuilder`; ``claim`` by the dispatcher)
a partition's ``table``      :class:`~._rebuild.RebuildReader` sets it; the table changes
                             itself, through its methods (fold, tail, acks, checkpoints)
a partition's ``saved``      :class:`~._checkpointer.Checkpointer`
committed offsets, topic     :class:`~._commit_tracker.CommitTracker`
deleted
rebalance summaries          :class:`~._rebalance_recorder.RebalanceRecorder`
membership figures           :class:`~deferline.runners.member.MemberFigures`, through
                             its methods (rebalances: the listener; rounds: the member's
                             producer; takeovers, fenced partitions: the lane)
the member's producer        the lane (started and stopped; its rounds are the
(transactions)               :class:`~._emitter.Emitter`'s pipeline, opened and closed here)
event counters, encoder      :class:`~._event_sink.EventSink`
trigger classes, deferrals   :class:`~._dispatcher.RecordDispatcher`
standing watches: current    :class:`~._watches.Watches`
run, failures, restarts
fetch paused, its bound      :class:`~._backpressure.FetchGate`
clients, tasks, closing,     :class:`TriggerLane`
``bootstrapped``
===========================  ==========================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.errors import KafkaError
from deferline.engine import TriggerOutcome, TriggerSupervisor
from deferline.schemas import KwargsCipher
from deferline.topics import (
    Settings,
    TopicNames,
    known_position,
    make_consumer,
    start_client,
    stop_client,
    trace_receive,
    tracing_on,
)

from .._aiokafka import (
    group_metadata,
    join_once,
    leave_from_generation_zero,
    request_rejoin,
    set_fetch_wait,
)
from ..member import (
    SHORT_WAIT_MS,
    MemberFigures,
    MemberListener,
    MemberProducer,
    StickyAssignor,
    diff_assignment,
)
from ._backpressure import FetchGate
from ._checkpoint import CheckpointStore
from ._checkpointer import Checkpointer
from ._commit_tracker import CommitTracker
from ._dispatcher import RecordDispatcher
from ._emitter import Emitter
from ._event_sink import EventSink
from ._input import RecordReader
from ._lane_types import (
    BootstrapError,
    LaneOptions,
    OutcomeRoute,
    OwnedPartition,
    RebalanceSummary,
    StopTrigger,
    TopicDeletedError,
    TriggererError,
    TriggerRef,
    WatchRef,
)
from ._metrics import TriggererMetrics
from ._partition_book import Verdict
from ._rebalance_recorder import RebalanceRecorder
from ._rebuild import Rebuilder, RebuildReader
from ._watches import Watches

__all__ = [
    "BootstrapError",
    "LaneOptions",
    "OwnedPartition",
    "RebalanceSummary",
    "TopicDeletedError",
    "TriggerLane",
    "TriggerRef",
    "TriggererError",
]

logger = logging.getLogger(__name__)

_EMIT, _REPEAT, _DROP = Verdict.EMIT, Verdict.REPEAT, Verdict.DROP
"""Bound once: the verdict of every outcome is compared on the fire path."""


class TriggerLane:
    """A consumer-group member on one trigger queue's defer topic.

    The fetch loop (:meth:`run`) and the rebalance callbacks share the partition map; the
    record handling between two awaits is synchronous, so a callback never sees a batch
    half applied.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        queue: str | None,
        options: LaneOptions,
        supervisor: TriggerSupervisor,
        emitter: Emitter,
        store: CheckpointStore,
        metrics: TriggererMetrics,
        cipher: KwargsCipher | None,
        cancel: StopTrigger,
        on_fatal: Callable[[BaseException], None],
        task_partitions: int | None,
        transactions: bool | None = False,
    ) -> None:
        """``task_partitions``: the partition count of tasks.events, where every event is
        copied keyed by its task (see :mod:`._event_sink`); None: no copies
        (``Settings.copy_events_to_tasks`` off). ``transactions``: write the events of the
        owned partitions in rounds of the member's one transactional producer (True: the
        broker must have KIP-447), when the broker has them (None), or never (False: every
        record goes through the emitter's shared producer)."""
        self.settings = settings
        self.queue = queue
        self.label = queue or "default"
        self.options = options
        self.member = options.member
        names = TopicNames(settings.topic_prefix)
        self.defer_topic = names.defer(queue)
        self.resume_topic = names.resume(queue)
        suffix = f".{queue}" if queue else ""
        self.group_id = f"{settings.topic_prefix}triggerer{suffix}"
        self.bootstrapped = asyncio.Event()
        """Set while no rebuild is running (cleared while new partitions are rebuilt)."""
        self._supervisor = supervisor
        self._emitter = emitter
        self._transactions = transactions
        self._producer: MemberProducer | None = None
        """The member's transactional producer (None: no transactions)."""
        self._metrics = metrics
        self._cancel = cancel
        self._on_fatal = on_fatal
        self._parts: dict[int, OwnedPartition] = {}
        self.figures = MemberFigures(owned=lambda: len(self._parts))
        """This member's membership figures (read by the triggerer's metrics)."""
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: AIOKafkaConsumer | None = None
        self._rebuild: asyncio.Task[None] | None = None
        self._losing: asyncio.Task[None] | None = None
        """Cancels the triggers of lost partitions (a rebuild waits for it)."""
        self._closing = False
        """Set by :meth:`release_all` and :meth:`close`: no rebuild starts from then on."""
        self._gate = FetchGate(label=self.label, metrics=metrics, log=self._log)
        self._assignor = StickyAssignor()
        self._checkpointer = Checkpointer(
            store,
            topic=self.defer_topic,
            max_age=options.checkpoint_max_age,
            metrics=metrics,
            log=self._log,
        )
        self._commits = CommitTracker(
            topic=self.defer_topic,
            group_id=self.group_id,
            within=options.flush_timeout,
            on_fatal=on_fatal,
            log=self._log,
        )
        self._rebalances = RebalanceRecorder(label=self.label, metrics=metrics, log=self._log)
        self._sink = EventSink(
            emitter,
            names=names,
            queue=queue,
            member=self.member,
            task_partitions=task_partitions,
            direct_resume=options.direct_resume,
            metrics=metrics,
            log=self._log,
        )
        self.route = OutcomeRoute(member=self.member, deliver=self.handle_outcome)
        """Where the outcomes of this lane's triggers go (carried by each TriggerRef)."""
        read = RecordReader(allowed_prefixes=settings.allowed_trigger_prefixes, cipher=cipher)
        self._watches = Watches(
            route=self.route,
            supervisor=supervisor,
            sink=self._sink,
            read=read,
            queue=queue,
            metrics=metrics,
            log=self._log,
        )
        self._dispatcher = RecordDispatcher(
            self.route,
            queue=queue,
            label=self.label,
            defer_topic=self.defer_topic,
            supervisor=supervisor,
            sink=self._sink,
            watches=self._watches,
            read=read,
            cancel=cancel,
            metrics=metrics,
            log=self._log,
        )
        self._rebuilder = Rebuilder(
            RebuildReader(
                defer_topic=self.defer_topic,
                resume_topic=self.resume_topic,
                options=options,
                checkpointer=self._checkpointer,
                prefix=settings.topic_prefix,
                group=self.group_id,
                log=self._log,
            ),
            dispatcher=self._dispatcher,
            recorder=self._rebalances,
            gate=self._gate,
            metrics=metrics,
            label=self.label,
            log=self._log,
        )

    def _log(self, part: int | None = None, **fields: Any) -> dict[str, Any]:
        return {"member": self.member, "queue": self.label, "partition": part, **fields}

    @property
    def watching(self) -> int:
        """Standing watches this lane runs (or will start again after a run)."""
        return len(self._watches)

    @property
    def rebalance_log(self) -> list[RebalanceSummary]:
        """The last rebalances of this lane (most recent last, at most 100)."""
        return self._rebalances.history

    # -- clients and the fetch loop -------------------------------------------------------------

    async def start(self) -> None:
        """Create the group consumer and the rebuild reader, and join the group."""
        common: dict[str, Any] = {
            "client_id": self.member,
            "max_partition_fetch_bytes": 8 * 1024 * 1024,
            "fetch_max_bytes": 64 * 1024 * 1024,
        }
        # The reader only reads partitions being rebuilt (data is there, or one empty fetch
        # to learn the end): a long poll would only delay that, on any broker.
        self._reader = make_consumer(
            self.settings,
            group_id=None,
            fetch_max_wait_ms=min(self.options.fetch_max_wait_ms, SHORT_WAIT_MS),
            **common,
        )
        rebalance_ms = max(self.options.session_timeout_ms, 30_000)
        self._consumer = make_consumer(
            self.settings,
            group_id=self.group_id,
            fetch_max_wait_ms=self.options.fetch_max_wait_ms,
            # The fetcher's own re-check period: seeks, resumes and consumed records wake it
            # anyway; a long poll needs no faster polling than its wait.
            consumer_timeout_ms=max(200, self.options.fetch_max_wait_ms),
            session_timeout_ms=self.options.session_timeout_ms,
            heartbeat_interval_ms=self.options.heartbeat_interval_ms,
            rebalance_timeout_ms=rebalance_ms,
            max_poll_records=self.options.max_poll_records,
            partition_assignment_strategy=(self._assignor, RoundRobinPartitionAssignor),
            group_instance_id=self.options.group_instance_id,
            **common,
        )
        await start_client(self._reader, grace=5.0, name="lane reader")
        await start_client(self._consumer, grace=5.0, name="lane consumer")
        leave_from_generation_zero(self._consumer)
        join_once(self._consumer)
        listener = MemberListener(
            self,
            consumer=self._consumer,
            topic=self.defer_topic,
            assignor=self._assignor,
            figures=self.figures,
            within=rebalance_ms / 2000,
            log=self._log,
        )
        await self._start_producer()
        self._consumer.subscribe([self.defer_topic], listener=listener)
        logger.info(
            "triggerer lane joining group",
            extra=self._log(
                group=self.group_id,
                topic=self.defer_topic,
                group_instance_id=self.options.group_instance_id,
            ),
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and apply the live tail until ``stop`` is set (checkpoints run beside it)."""
        consumer = self._consumer
        assert consumer is not None, "start() first"
        ticker = asyncio.create_task(self._checkpoint_loop(stop), name="checkpoints")
        try:
            while not stop.is_set():
                self._gate.check(
                    consumer,
                    self._supervisor.pending + self._emitter.backlog,
                    [p.defer_tp for p in self._parts.values() if p.live],
                )
                try:
                    batches = await consumer.getmany(
                        timeout_ms=200, max_records=self.options.max_poll_records
                    )
                except KafkaError as exc:
                    if not getattr(exc, "retriable", False):
                        raise TriggererError(
                            f"consumer failed on {self.defer_topic}: {exc}"
                        ) from exc
                    logger.warning("fetch failed; retrying", extra=self._log(error=repr(exc)))
                    await asyncio.sleep(0.5)
                    continue
                for tp, records in batches.items():
                    part = self._parts.get(tp.partition)
                    if part is not None and part.live:
                        for record in records if tracing_on() else ():
                            trace_receive(tp.topic, record.value, record.headers)
                        self._dispatcher.apply_live(part, records)
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker

    async def release_all(self) -> None:
        """Give up every owned partition cleanly (shutdown): flush, checkpoint, commit.

        The triggers are not cancelled here: the supervisor stops them all once the member
        has left the group, so the peers start rebuilding these partitions that much sooner
        (see docs/benchmarks.md). Nothing is emitted for them from the moment the release
        starts: an outcome of a releasing partition is dropped.
        """
        self._closing = True
        await self._cancel_rebuild()
        losing = self._losing
        if losing is not None:
            # A loss still cancelling its triggers ends first. One that failed or was cancelled
            # on the way (a rebalance met the shutdown) stops nothing here: it logged why, and
            # the supervisor stops every trigger once the member has left the group.
            await asyncio.wait([losing])
            if not losing.cancelled():
                losing.exception()  # retrieved: logged by _cancel_lost already
            self._losing = None
        await self._release(list(self._parts.values()), cancel=False)

    async def close(self) -> None:
        """Leave the group (peers take the partitions over at once) and close the reader.

        A rebuild still running is cancelled first: it reads over both clients, and a request
        of it in flight while they close would open a connection nothing closes.
        """
        self._closing = True
        self._watches.close()
        await self._cancel_rebuild()
        consumer, self._consumer = self._consumer, None
        reader, self._reader = self._reader, None
        for client in (consumer, reader):
            if client is not None:
                await stop_client(client, grace=self.options.flush_timeout, name="consumer")
        producer, self._producer = self._producer, None
        if producer is not None:
            await self._emitter.close(producer.transactional_id)
            await producer.stop()

    # -- outcomes -------------------------------------------------------------------------------

    def handle_outcome(self, ref: TriggerRef, outcome: TriggerOutcome) -> None:
        """An event from the supervisor (synchronous): its partition's book says whether
        it is emitted, held or dropped; an emitted trigger is then cancelled. A standing
        watch's go to :class:`~._watches.Watches` (each published, the watch going on)."""
        if type(ref) is WatchRef:
            self._watches.outcome(ref, outcome)
            return
        part = ref.part
        verdict = part.book.outcome(ref.key, (ref, outcome))
        if verdict is _EMIT:
            part.table.note_emitting(ref.key)
            if not outcome.final:
                # The first event resumes the task; a multi-event trigger is stopped here.
                self._cancel(outcome.trigger_id)
            self._sink.outcome(ref, outcome)
        elif verdict is _REPEAT:
            self._metrics.extra_events_dropped.inc()
            if not outcome.final:
                self._cancel(outcome.trigger_id)
        elif verdict is _DROP:
            # Lost to another member, or being released: the next owner fires it.
            logger.debug(
                "outcome of a partition not emitted for dropped",
                extra=self._log(part.number, trigger_id=outcome.trigger_id),
            )

    # -- rebalances -----------------------------------------------------------------------------

    async def quiesce(self, partitions: frozenset[int]) -> None:
        """Quiesce the revoked partitions: stop emitting, flush, checkpoint and commit.

        Nothing is cancelled: the next assignment tells which partitions stay here. Every
        member runs this before it rejoins, and no member is assigned anything before all
        have rejoined, so no two members ever emit for one partition. A partition still
        being rebuilt is released outright (its rebuild is cancelled).
        """
        await self._cancel_rebuild()
        self._rebalances.revoked()
        now = time.monotonic()
        parts = self._owned_among(partitions)
        quiet = [p for p in parts if p.ready]
        for part in quiet:
            part.book.quiesce(now)
        await self._release([p for p in parts if not p.ready])
        if not quiet:
            return
        await self._flush()
        for part in quiet:
            await self._checkpointer.save(part, rebuilt=True)
        await self._commit(quiet)
        logger.info(
            "partitions quiesced",
            extra=self._log(
                partitions=sorted(p.number for p in quiet),
                seconds=round(time.monotonic() - now, 3),
            ),
        )

    async def assign(self, generation: int, partitions: frozenset[int]) -> None:
        """Resume kept partitions, cancel lost ones, rebuild new ones in the background.

        aiokafka sends no heartbeats while this callback runs, so the long parts (reading
        new partitions, cancelling the triggers of lost ones) happen in tasks; new
        partitions stay paused until their rebuild is done.
        """
        consumer = self._consumer
        if consumer is None or self._closing:
            # Shutting down: an assignment that arrives while this member releases its
            # partitions (a peer left or joined meanwhile) is not served; the peers take
            # it over once this member has left.
            return
        now = time.monotonic()
        change = diff_assignment(self._parts, partitions)
        kept = [self._parts[n] for n in change.kept]
        lost = [self._parts[n] for n in change.released]
        new = [TopicPartition(self.defer_topic, n) for n in change.acquired]
        # Lost: gone now (outcomes of their triggers are dropped from here on); their
        # triggers are cancelled in the background, without emitting.
        self._rebalances.assigned(
            generation,
            kept=[p.number for p in kept],
            acquired=[tp.partition for tp in new],
            lost=[p.number for p in lost],
            triggers_kept=sum(len(p.table) for p in kept),
            triggers_cancelled=self._lose(lost),
        )

        # Kept: follow the tail from where the lane stopped, emit what was held.
        for part in kept:
            held, since = part.book.keep()
            consumer.seek(part.defer_tp, part.table.defer_offset)
            self._rebalances.paused(part.number, now if since is None else since)
            for ref, outcome in held:
                if type(ref) is WatchRef:
                    self._watches.publish(ref, outcome)  # numbered when it was held
                else:
                    self.handle_outcome(ref, outcome)
        if kept and self._gate.paused:
            consumer.pause(*(p.defer_tp for p in kept))

        # New: rebuild from the checkpoint and the topics.
        parts = []
        for tp in new:
            self._commits.forget(tp)
            part = OwnedPartition(
                number=tp.partition,
                defer_tp=tp,
                resume_tp=TopicPartition(self.resume_topic, tp.partition),
            )
            self._parts[tp.partition] = part
            parts.append(part)
        logger.info(
            "partitions assigned",
            extra=self._log(
                partitions=sorted(self._parts),
                kept=[p.number for p in kept],
                acquired=[p.number for p in parts],
                lost=[p.number for p in lost],
                generation=generation,
            ),
        )
        if not parts:
            self._rebalances.finish()
            self.bootstrapped.set()
            return
        consumer.pause(*new)
        set_fetch_wait(consumer, min(self.options.fetch_max_wait_ms, SHORT_WAIT_MS))
        self.bootstrapped.clear()
        self._rebuild = asyncio.create_task(self._rebuild_guarded(parts), name="rebuild")

    async def rejoined(self, member_id: str) -> None:
        """The lane joined again as a new member (paused past its session, say): another
        member may have owned its partitions meanwhile, so none is kept as it was."""
        if self._consumer is None or self._closing or not self._parts:
            return
        logger.warning(
            "lane rejoined as a new member: its partitions are taken over afresh",
            extra=self._log(partitions=sorted(self._parts), member_id=member_id),
        )
        self._lose(list(self._parts.values()))

    def quiesce_cut_short(self, partitions: frozenset[int]) -> None:
        """After a revocation cut short: the revoked partitions that were not ready (their
        rebuild or release interrupted) are lost here, so the next assignment rebuilds them
        rather than keep them half-built. Ready ones stay: kept, they resume; else lost."""
        self._lose([p for p in self._owned_among(partitions) if not p.ready])

    def _owned_among(self, partitions: Iterable[int]) -> list[OwnedPartition]:
        return [part for n in partitions if (part := self._parts.get(n)) is not None]

    def _lose(self, parts: list[OwnedPartition]) -> int:
        """``parts`` are gone now; their triggers are cancelled in the background, without
        emitting (a rebuild waits for that). The number of triggers cancelled."""
        cancelled: list[str] = []
        if self._producer is not None:
            self._emitter.discard(self._producer.transactional_id, (p.defer_tp for p in parts))
        for part in parts:
            self._parts.pop(part.number, None)
            part.book.gone()
            self._watches.forget_partition(part)
            cancelled.extend(self._running(part))
        if parts:
            previous = self._losing
            self._losing = asyncio.create_task(
                self._cancel_lost(previous, parts, cancelled), name="cancel-lost-partitions"
            )
        return len(cancelled)

    def _running(self, part: OwnedPartition) -> list[str]:
        """The ids of the partition's triggers that the supervisor runs."""
        supervisor = self._supervisor
        return [tid for key in part.table if (tid := key.decode(errors="replace")) in supervisor]

    async def _cancel_lost(
        self,
        previous: asyncio.Task[None] | None,
        parts: list[OwnedPartition],
        trigger_ids: list[str],
    ) -> None:
        """Cancel the triggers of lost partitions (their outcomes are dropped) and close
        their checkpoints, after the previous loss's. A failure is logged here and raised
        to whoever waits for it (a rebuild then fails: it must not run a second copy)."""
        try:
            if previous is not None:
                await previous
            await self._supervisor.cancel_many(trigger_ids)
            for part in parts:
                await self._checkpointer.release(part.number)
        except Exception:
            logger.exception(
                "cancelling the triggers of lost partitions failed",
                extra=self._log(partitions=[p.number for p in parts]),
            )
            raise
        logger.info(
            "lost partitions dropped",
            extra=self._log(
                partitions=[p.number for p in parts], triggers_cancelled=len(trigger_ids)
            ),
        )

    async def _await_losing(self) -> None:
        """Wait until lost partitions' triggers are cancelled (before rebuilding any)."""
        task = self._losing
        if task is not None:
            await task
            if self._losing is task:
                self._losing = None

    async def _release(self, parts: list[OwnedPartition], *, cancel: bool = True) -> None:
        """Stop emitting for ``parts``, flush, checkpoint, commit and let them go; with
        ``cancel``, their triggers are cancelled first (else the caller stops them)."""
        rebuilt = [p for p in parts if p.ready]
        parts = [p for p in parts if p.book.release()]
        if not parts:
            return
        started = time.monotonic()
        ids = [tid for part in parts for tid in self._running(part)]
        if cancel:
            await self._supervisor.cancel_many(ids)
        await self._flush()
        for part in parts:
            await self._checkpointer.save(part, rebuilt=part in rebuilt)
            await self._checkpointer.release(part.number)
        await self._commit([p for p in parts if p in rebuilt])
        for part in parts:
            part.book.gone()
            self._watches.forget_partition(part)
            self._parts.pop(part.number, None)
        logger.info(
            "partitions released",
            extra=self._log(
                partitions=[p.number for p in parts],
                triggers_cancelled=len(ids) if cancel else 0,
                seconds=round(time.monotonic() - started, 3),
            ),
        )

    async def _flush(self) -> None:
        if not await self._emitter.flush(self.options.flush_timeout):
            logger.error(
                "pending sends not flushed before revocation; the next owner re-runs them",
                extra=self._log(backlog=self._emitter.backlog),
            )

    # -- transactions ---------------------------------------------------------------------------

    async def _start_producer(self) -> None:
        """Start the member's transactional producer and open the emitter's pipeline on it
        (no-op without transactions, or on a broker without KIP-447 when they are optional)."""
        if self._transactions is False:
            return
        consumer = self._consumer
        assert consumer is not None
        producer = MemberProducer(
            self.settings,
            group_id=self.group_id,
            name=uuid.uuid4().hex,
            member=lambda: group_metadata(consumer),
            figures=self.figures,
            transactions=self._transactions,
            # A member that died with a round open holds its partitions no longer than the
            # group takes to notice.
            transaction_timeout=self.options.session_timeout_ms / 1000,
        )
        await producer.start()
        if not producer.transactional:
            await producer.stop()
            return
        self._producer = producer
        self._emitter.open(
            producer.transactional_id,
            producer,
            offset_of=self._round_offset,
            on_fenced=self._fenced,
        )

    async def _stable(self, parts: list[OwnedPartition]) -> None:
        """Wait until no round of a previous owner holds the offsets of newly acquired
        ``parts`` (OffsetFetch ``require_stable``): every round carries the offsets of the
        partitions it writes, so from here on the old owner's records there are decided and
        the rebuild reads past them. Their emissions then go into this member's rounds."""
        producer = self._producer
        if producer is None:
            return
        await producer.committed([p.defer_tp for p in parts])
        for part in parts:
            part.owner = producer.transactional_id

    def _round_offset(self, tp: TopicPartition) -> int | None:
        """The read offset of an owned defer partition, committed in each round that writes
        its records; None once it is no longer owned (its emissions are dropped)."""
        part = self._parts.get(tp.partition)
        if part is None or not part.book.owned:
            return None
        return max(part.table.defer_offset, self._commits.committed(tp) or 0)

    def _fenced(self) -> None:
        """The group refused a round: this member lost its partitions without hearing of it
        yet (paused past its session, say). They are dropped now, without emitting, and the
        member rejoins to learn its assignment."""
        parts = list(self._parts.values())
        logger.warning(
            "partitions fenced by the group; dropped, rejoining the group",
            extra=self._log(partitions=sorted(p.number for p in parts)),
        )
        self.figures.fenced(len(parts))
        self._lose(parts)
        if self._consumer is not None and not self._closing:
            request_rejoin(self._consumer)

    # -- rebuild --------------------------------------------------------------------------------

    async def _cancel_rebuild(self) -> None:
        task, self._rebuild = self._rebuild, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _rebuild_guarded(self, parts: list[OwnedPartition]) -> None:
        try:
            started = time.monotonic()
            # A partition lost and won back: its old triggers must be gone before it is rebuilt.
            await self._await_losing()
            consumer, reader = self._consumer, self._reader
            assert consumer is not None
            assert reader is not None
            await self._stable(parts)
            await self._rebuilder.run(consumer, reader, parts, started=started)
            self.figures.took_over(len(parts), time.monotonic() - started)
            self._rebuild = None
            self._rebalances.finish()
            self.bootstrapped.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("rebuild failed", extra=self._log(error=repr(exc)))
            self._on_fatal(BootstrapError(f"rebuild of {self.defer_topic} failed: {exc}"))
        finally:
            if self._consumer is not None:
                set_fetch_wait(self._consumer, self.options.fetch_max_wait_ms)

    # -- checkpoints and commits ----------------------------------------------------------------

    async def _checkpoint_loop(self, stop: asyncio.Event) -> None:
        """Checkpoint and commit every ``checkpoint_interval`` s, off the fetch path."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.options.checkpoint_interval)
            if stop.is_set() or await self._commits.topic_deleted(self._consumer, self._reader):
                return
            try:
                await self.checkpoint_all()
            except Exception:
                logger.exception("periodic checkpoint failed", extra=self._log())

    async def checkpoint_all(self) -> None:
        """Checkpoint every live partition and commit the positions of the rebuilt ones."""
        parts = [p for p in self._parts.values() if p.live]
        for part in parts:
            await self._checkpointer.save(part, rebuilt=part.ready)
        await self._commit([p for p in parts if p.ready])

    async def _commit(self, parts: list[OwnedPartition]) -> None:
        offsets = {p.defer_tp: await self._read_to(p) for p in parts}
        await self._commits.commit(self._consumer, self._reader, offsets)

    async def _read_to(self, part: OwnedPartition) -> int:
        """How far ``part`` is read: the next offset its table folds or, while it is live,
        the consumer's position when that is further.

        Past the partition's last record come the markers of the transactions that wrote its
        tombstones (Apache Kafka): offsets, but no records, which the consumer's position has
        skipped. Committed at the last record, the group would show a lag of one for ever
        (end offset less committed offset, as every tool computes it). A live partition's
        position is past only what its fetches returned, all of it folded (it went live
        with a seek to its table's offset, and records are applied as they are returned).
        """
        offset = part.table.defer_offset
        if self._consumer is None or not (part.live and part.ready):
            return offset
        position = await known_position(self._consumer, part.defer_tp)
        return offset if position is None else max(offset, position)

    def set_max_pending(self, bound: int) -> None:
        """Pause fetching while pending triggers plus unsent events exceed ``bound``."""
        self._gate.set_bound(bound)

    # -- introspection --------------------------------------------------------------------------

    def partitions(self) -> list[tuple[str, int, int, int]]:
        """``(queue, partition, active_triggers, consumer_lag)`` for the metrics."""
        consumer = self._consumer
        rows = []
        for part in self._parts.values():
            lag = 0
            if consumer is not None:
                high = consumer.highwater(part.defer_tp)
                if high is not None:
                    # The last commit may be past the table's offset: past the markers.
                    read = max(part.table.defer_offset, self._commits.committed(part.defer_tp) or 0)
                    lag = max(0, high - read)
            rows.append((self.label, part.number, len(part.table), lag))
        return rows

    @property
    def owned(self) -> list[int]:
        """Numbers of the owned partitions."""
        return sorted(self._parts)
