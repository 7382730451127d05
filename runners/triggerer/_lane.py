"""One trigger queue of a triggerer: a consumer-group member on that queue's defer topic.

Partition assignment decides which triggers this member runs. For each newly assigned
partition the lane rebuilds the active set (checkpoint, then the defer tail up to the end
offset seen at assignment), drops triggers whose event is already on the co-partitioned
resume topic, starts the rest and follows the live tail.

Rebalances are incremental on top of the eager protocol (which revokes every partition on
every rebalance): a sticky assignor keeps partitions where they are, and on revocation the
lane only *quiesces* (stops emitting and applying records for the partitions, holds the
events their triggers produce, flushes what is in flight, checkpoints and commits) without
cancelling anything. The next assignment settles it: kept partitions resume at once (held
events emitted, triggers never stopped), lost ones are cancelled without emitting (their
new owner rebuilds and fires them), new ones are rebuilt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.errors import KafkaError, UnknownTopicOrPartitionError
from aiokafka.protocol.group import LeaveGroupRequest
from aiokafka.protocol.metadata import MetadataRequest
from deferline.engine import TriggerOutcome, TriggerSupervisor
from deferline.schemas import (
    DeadLetter,
    DeferlineError,
    DeferRequest,
    KwargsCipher,
    RunTask,
    TaskKey,
    TriggerEventRecord,
    decode_as,
    encode,
    make_event_id,
)
from deferline.topics import Settings, TopicNames, make_consumer, stop_client

from ._checkpoint import CheckpointError, CheckpointStore, PartitionCheckpoint
from ._emitter import Emission, Emitter, Send
from ._events import EventEncoder, request_fields
from ._fetch_wait import SHORT_WAIT_MS
from ._input import BadRecord, CancelTrigger, StartTrigger, interpret, peek_identity
from ._metrics import TriggererMetrics
from ._partition_table import ActiveTriggerTable
from ._sticky_assignor import StickyAssignor

__all__ = [
    "BootstrapError",
    "LaneOptions",
    "RebalanceSummary",
    "TriggerLane",
    "TriggerRef",
    "TriggererError",
]

logger = logging.getLogger(__name__)

_YIELD_EVERY = 2000


class TriggererError(DeferlineError):
    """The triggerer cannot go on (it stops, and its partitions move to other members)."""


class BootstrapError(TriggererError):
    """Rebuilding the active set of assigned partitions failed."""


class TopicDeletedError(TriggererError):
    """A topic the triggerer serves was deleted while it ran (its table is gone with it)."""


@dataclass(frozen=True, kw_only=True)
class LaneOptions:
    """How a lane talks to the broker; see :class:`deferline.runners.triggerer.TriggererOptions`."""

    member: str
    direct_resume: bool = False
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 1_000
    fetch_max_wait_ms: int = 20
    max_poll_records: int = 2_000
    checkpoint_interval: float = 5.0
    checkpoint_max_age: float = 12 * 3600.0
    resume_skew_margin: float = 600.0
    flush_timeout: float = 10.0
    bootstrap_stall_timeout: float = 60.0
    group_instance_id: str | None = None
    """Static membership (KIP-345): rejoining under this id within the session timeout
    gets the same partitions back without a rebalance."""


@dataclass(slots=True, eq=False)
class TriggerRef:
    """What the supervisor carries for each trigger: where it came from (no decoded copy)."""

    lane: TriggerLane
    partition: int
    key: bytes
    value: bytes

    @property
    def member(self) -> str:
        """The member running it (read by the supervisor's log lines)."""
        return self.lane.member

    @property
    def task(self) -> str | None:
        """The task key, decoded on demand (only log lines need it)."""
        _, task, _ = peek_identity(self.value)
        return str(task) if task is not None else None


@dataclass(slots=True, eq=False)
class OwnedPartition:
    """One assigned defer partition and its co-partitioned resume partition."""

    number: int
    defer_tp: TopicPartition
    resume_tp: TopicPartition
    table: ActiveTriggerTable = field(default_factory=ActiveTriggerTable)
    done: set[bytes] = field(default_factory=set)
    """Keys whose event (or tombstone) is produced or queued: never emit for them again."""
    ready: bool = False
    """The rebuild finished: the table reflects the log up to ``table.defer_offset``."""
    live: bool = False
    """Records from the group consumer are applied (ready and not being released)."""
    checkpointable: bool = True
    saved: tuple[int, int] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    read_defer: int = 0
    read_resume: int = 0
    quiesced_at: float | None = None
    """Set while revoked and not yet re-assigned: nothing is emitted for the partition."""
    held: list[tuple[TriggerRef, TriggerOutcome]] = field(default_factory=list)
    """Outcomes produced while quiesced: emitted if the partition is kept, else dropped."""


@dataclass(slots=True, kw_only=True)
class RebalanceSummary:
    """What one rebalance did to one lane (logged once, and kept in ``lane.rebalance_log``)."""

    generation: int
    kept: list[int]
    acquired: list[int]
    lost: list[int]
    triggers_kept: int = 0
    triggers_cancelled: int = 0
    triggers_rebuilt: int = 0
    paused_seconds: dict[int, float] = field(default_factory=dict)
    """Per partition: from revocation (or assignment, for a member that had nothing) until
    it emitted again (kept) or its rebuild finished (acquired)."""
    revoked_at: float | None = None
    """Wall-clock time the lane quiesced (None: it owned nothing before)."""
    assigned_at: float = 0.0
    """Wall-clock time the assignment arrived (kept partitions emit again from here)."""


def _leave_from_generation_zero(consumer: AIOKafkaConsumer) -> None:
    """Make ``consumer.stop()`` leave the group also when its generation is 0.

    aiokafka sends LeaveGroup only from generation > 0 (Kafka numbers generations from 1),
    but Tansu numbers the first generation 0: a member stopped in it would hold its
    partitions until its session timed out instead of handing them over at once.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    original = getattr(coordinator, "_maybe_leave_group", None)
    if coordinator is None or original is None:
        return

    async def leave() -> None:
        if (
            coordinator.generation == 0
            and coordinator.member_id
            and getattr(coordinator, "_group_instance_id", None) is None
        ):
            request = LeaveGroupRequest(coordinator.group_id, coordinator.member_id)
            try:
                await coordinator._send_req(request)
            except KafkaError as exc:
                logger.warning("LeaveGroup failed", extra={"error": repr(exc)})
            coordinator.reset_generation()
            return
        await original()

    coordinator._maybe_leave_group = leave


def _set_fetch_wait(consumer: AIOKafkaConsumer | None, wait_ms: int) -> None:
    """Change the broker-side wait of the consumer's next fetch requests.

    With a long poll, a partition resumed after its rebuild would wait for the fetch in
    flight (up to the whole wait) before it is fetched: aiokafka sends one fetch per broker
    at a time. While a rebuild runs the lane polls short, so the live tail of the rebuilt
    partitions starts within the short wait.
    """
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is not None and hasattr(fetcher, "_fetch_max_wait_ms"):
        fetcher._fetch_max_wait_ms = wait_ms


_UNPRODUCIBLE = {"error": "event not producible"}


def _unproducible_id(trigger_id: str) -> str:
    return make_event_id(trigger_id, "failed", _UNPRODUCIBLE)


@dataclass(slots=True, eq=False)
class _EventInfo:
    """What the ack and failure callbacks of one queued event need to know."""

    trigger_id: str
    status: str
    event_id: str
    direct: bool
    value: bytes | None = None
    """The stored DeferRequest (hot path: decoded only if a log line or a failure needs it)."""
    task_key: TaskKey | None = None
    seq: int = 0

    def task(self) -> TaskKey | None:
        return self.task_key if self.task_key is not None else peek_identity(self.value)[1]

    def defer_seq(self) -> int:
        return peek_identity(self.value)[2] if self.value is not None else self.seq


@dataclass(slots=True, eq=False)
class _QueuedEvent:
    """One event in the emitter; its ack and failure callbacks (one small object each)."""

    lane: TriggerLane
    part: OwnedPartition | None
    key: bytes
    number: int
    tombstone: bool
    info: _EventInfo

    def acked(self, metadata: Sequence[Any]) -> None:
        self.lane._event_acked(self, int(metadata[0].offset))

    def failed(self, error: BaseException) -> None:
        self.lane._event_failed(self, error)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Rebalance callbacks of one lane, as aiokafka's listener object."""

    def __init__(self, lane: TriggerLane) -> None:
        self._lane = lane

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._lane.on_partitions_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._lane.on_partitions_assigned(set(assigned))


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
        cancel: Callable[[str], None],
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        self.settings = settings
        self.queue = queue
        self.label = queue or "default"
        self.options = options
        self.member = options.member
        names = TopicNames(settings.topic_prefix)
        self.names = names
        self.defer_topic = names.defer(queue)
        self.resume_topic = names.resume(queue)
        suffix = f".{queue}" if queue else ""
        self.group_id = f"{settings.topic_prefix}triggerer{suffix}"
        self._supervisor = supervisor
        self._emitter = emitter
        self._store = store
        self._metrics = metrics
        self._cipher = cipher
        self._cancel = cancel
        self._on_fatal = on_fatal
        self._allowed = tuple(settings.allowed_trigger_prefixes)
        self._parts: dict[int, OwnedPartition] = {}
        self._topic_deleted = False
        self._committed: dict[TopicPartition, int] = {}
        self._encoder = EventEncoder()
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: AIOKafkaConsumer | None = None
        self._bootstrap: asyncio.Task[None] | None = None
        self._paused = False
        self._event_counters: dict[str, Any] = {}
        self._assignor = StickyAssignor()
        self._revoked_at: float | None = None
        self._dropping: asyncio.Task[None] | None = None
        self._summary: RebalanceSummary | None = None
        self.rebalance_log: list[RebalanceSummary] = []
        """The last rebalances of this lane (most recent last, at most 100)."""
        self.bootstrapped = asyncio.Event()

    # -- lifecycle ----------------------------------------------------------------------------

    def _log(self, part: int | None = None, **fields: Any) -> dict[str, Any]:
        return {"member": self.member, "queue": self.label, "partition": part, **fields}

    async def start(self) -> None:
        """Create the group consumer and the bootstrap reader, and join the group."""
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
        self._consumer = make_consumer(
            self.settings,
            group_id=self.group_id,
            fetch_max_wait_ms=self.options.fetch_max_wait_ms,
            # The fetcher's own re-check period: seeks, resumes and consumed records wake it
            # anyway; a long poll needs no faster polling than its wait.
            consumer_timeout_ms=max(200, self.options.fetch_max_wait_ms),
            session_timeout_ms=self.options.session_timeout_ms,
            heartbeat_interval_ms=self.options.heartbeat_interval_ms,
            rebalance_timeout_ms=max(self.options.session_timeout_ms, 30_000),
            max_poll_records=self.options.max_poll_records,
            partition_assignment_strategy=(self._assignor, RoundRobinPartitionAssignor),
            group_instance_id=self.options.group_instance_id,
            **common,
        )
        await self._reader.start()
        await self._consumer.start()
        _leave_from_generation_zero(self._consumer)
        self._consumer.subscribe([self.defer_topic], listener=_Listener(self))
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
                self._apply_backpressure()
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
                        self._apply_live(part, records)
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker

    async def _checkpoint_loop(self, stop: asyncio.Event) -> None:
        """Checkpoint and commit every ``checkpoint_interval`` s, off the fetch path."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.options.checkpoint_interval)
            if stop.is_set() or await self._defer_topic_deleted():
                return
            try:
                await self.checkpoint_all(commit=True)
            except Exception:
                logger.exception("periodic checkpoint failed", extra=self._log())

    async def release_all(self) -> None:
        """Give up every owned partition cleanly (shutdown): cancel, flush, checkpoint, commit."""
        await self._cancel_bootstrap()
        await self._await_dropping()
        await self._release(list(self._parts.values()))

    async def close(self) -> None:
        """Leave the group (peers take the partitions over at once) and close the reader."""
        consumer, self._consumer = self._consumer, None
        reader, self._reader = self._reader, None
        for client in (consumer, reader):
            if client is not None:
                await stop_client(client, grace=self.options.flush_timeout, name="consumer")

    # -- rebalance ----------------------------------------------------------------------------

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Quiesce the revoked partitions: stop emitting, flush, checkpoint and commit.

        Nothing is cancelled: the next assignment tells which partitions stay here. Every
        member runs this before it rejoins, and no member is assigned anything before all
        have rejoined, so no two members ever emit for one partition. A partition still
        being rebuilt is released outright (its rebuild is cancelled).
        """
        await self._cancel_bootstrap()
        now = time.monotonic()
        self._revoked_at = now
        self._revoked_wall = time.time()
        if self._summary is not None:  # the previous rebalance's rebuild was interrupted
            self._finish_rebalance()
        parts = [
            self._parts[tp.partition]
            for tp in revoked
            if tp.topic == self.defer_topic and tp.partition in self._parts
        ]
        unready = [p for p in parts if not p.ready]
        quiet = [p for p in parts if p.ready]
        for part in quiet:
            part.live = False
            if part.quiesced_at is None:
                part.quiesced_at = now
        if unready:
            await self._release(unready)
        if not quiet:
            return
        if not await self._emitter.flush(self.options.flush_timeout):
            logger.error(
                "pending sends not flushed before revocation; the next owner re-runs them",
                extra=self._log(backlog=self._emitter.backlog),
            )
        for part in quiet:
            await self._checkpoint(part)
        await self._commit(quiet)
        logger.info(
            "partitions quiesced",
            extra=self._log(
                partitions=sorted(p.number for p in quiet),
                seconds=round(time.monotonic() - now, 3),
            ),
        )

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Resume kept partitions, drop lost ones, rebuild new ones in the background.

        aiokafka sends no heartbeats while this callback runs, so the long parts (reading
        new partitions, cancelling the triggers of lost ones) happen in tasks; new
        partitions stay paused until their rebuild is done.
        """
        consumer = self._consumer
        if consumer is None:  # closing: the assignment arrived while leaving
            return
        now = time.monotonic()
        started = self._revoked_at if self._revoked_at is not None else now
        self._revoked_at = None
        coordinator = getattr(consumer, "_coordinator", None)
        generation = int(getattr(coordinator, "generation", -1))
        self._assignor.note_generation(generation)
        mine = {tp.partition for tp in assigned if tp.topic == self.defer_topic}
        kept = [p for n, p in sorted(self._parts.items()) if n in mine]
        lost = [p for n, p in sorted(self._parts.items()) if n not in mine]
        new = sorted(
            (
                tp
                for tp in assigned
                if tp.topic == self.defer_topic and tp.partition not in self._parts
            ),
            key=lambda tp: tp.partition,
        )
        summary = RebalanceSummary(
            generation=generation,
            kept=[p.number for p in kept],
            acquired=[tp.partition for tp in new],
            lost=[p.number for p in lost],
            revoked_at=self._revoked_wall if started != now else None,
            assigned_at=time.time(),
        )
        self._metrics.rebalances.labels(queue=self.label).inc()

        # Lost: forget them now (outcomes of their triggers are dropped from here on), cancel
        # their triggers in the background, without emitting.
        cancelled: list[str] = []
        for part in lost:
            self._parts.pop(part.number, None)
            part.held.clear()
            cancelled.extend(
                tid
                for key in part.table
                if (tid := key.decode(errors="replace")) in self._supervisor
            )
        summary.triggers_cancelled = len(cancelled)
        if lost:
            previous = self._dropping
            self._dropping = asyncio.create_task(
                self._drop(previous, lost, cancelled), name="drop-lost-partitions"
            )

        # Kept: follow the tail from where the lane stopped, emit what was held.
        for part in kept:
            summary.triggers_kept += len(part.table)
            paused_since = part.quiesced_at if part.quiesced_at is not None else now
            part.quiesced_at = None
            part.live = True
            consumer.seek(part.defer_tp, part.table.defer_offset)
            summary.paused_seconds[part.number] = time.monotonic() - paused_since
            held, part.held = part.held, []
            for ref, outcome in held:
                self.handle_outcome(ref, outcome)
        if kept and self._paused:
            consumer.pause(*(p.defer_tp for p in kept))

        # New: rebuild from the checkpoint and the topics.
        parts = []
        for tp in new:
            self._committed.pop(tp, None)
            part = OwnedPartition(
                number=tp.partition,
                defer_tp=tp,
                resume_tp=TopicPartition(self.resume_topic, tp.partition),
            )
            self._parts[tp.partition] = part
            parts.append(part)
        self._metrics.assigned_partitions.labels(queue=self.label).set(len(self._parts))
        logger.info(
            "partitions assigned",
            extra=self._log(
                partitions=sorted(self._parts),
                kept=summary.kept,
                acquired=summary.acquired,
                lost=summary.lost,
                generation=generation,
            ),
        )
        self._summary = summary
        self._rebalance_started = started
        if not parts:
            self._finish_rebalance()
            self.bootstrapped.set()
            return
        consumer.pause(*new)
        _set_fetch_wait(consumer, min(self.options.fetch_max_wait_ms, SHORT_WAIT_MS))
        self.bootstrapped.clear()
        self._bootstrap = asyncio.create_task(self._bootstrap_guarded(parts), name="bootstrap")

    _rebalance_started: float = 0.0
    _revoked_wall: float = 0.0

    def _finish_rebalance(self) -> None:
        """Count, record and log the rebalance in progress (once its rebuild is over)."""
        summary, self._summary = self._summary, None
        if summary is None:
            return
        metrics, queue = self._metrics, self.label
        for outcome, numbers in (
            ("kept", summary.kept),
            ("acquired", summary.acquired),
            ("lost", summary.lost),
        ):
            metrics.rebalance_partitions.labels(queue=queue, outcome=outcome).inc(len(numbers))
        for action, count in (
            ("kept", summary.triggers_kept),
            ("cancelled", summary.triggers_cancelled),
            ("rebuilt", summary.triggers_rebuilt),
        ):
            metrics.rebalance_triggers.labels(queue=queue, action=action).inc(count)
        for seconds in summary.paused_seconds.values():
            metrics.partition_pause_seconds.labels(queue=queue).observe(seconds)
        self.rebalance_log.append(summary)
        del self.rebalance_log[:-100]
        pauses = list(summary.paused_seconds.values())
        logger.info(
            "rebalance",
            extra=self._log(
                generation=summary.generation,
                partitions_kept=len(summary.kept),
                partitions_acquired=len(summary.acquired),
                partitions_lost=len(summary.lost),
                triggers_kept=summary.triggers_kept,
                triggers_cancelled=summary.triggers_cancelled,
                triggers_rebuilt=summary.triggers_rebuilt,
                paused_seconds={
                    str(n): round(s, 3) for n, s in sorted(summary.paused_seconds.items())
                },
                max_paused_seconds=round(max(pauses), 3) if pauses else 0.0,
            ),
        )

    async def _drop(
        self,
        previous: asyncio.Task[None] | None,
        parts: list[OwnedPartition],
        trigger_ids: list[str],
    ) -> None:
        """Cancel the triggers of lost partitions (their outcomes are dropped) and close them."""
        if previous is not None:
            with contextlib.suppress(Exception):
                await previous
        for start in range(0, len(trigger_ids), _YIELD_EVERY):
            chunk = trigger_ids[start : start + _YIELD_EVERY]
            await asyncio.gather(*(self._supervisor.cancel(tid) for tid in chunk))
        for part in parts:
            with contextlib.suppress(CheckpointError):
                await asyncio.to_thread(self._store.release, self.defer_topic, part.number)
        logger.info(
            "lost partitions dropped",
            extra=self._log(
                partitions=[p.number for p in parts], triggers_cancelled=len(trigger_ids)
            ),
        )

    async def _await_dropping(self) -> None:
        """Wait until lost partitions' triggers are cancelled (before rebuilding any)."""
        task = self._dropping
        if task is not None:
            with contextlib.suppress(Exception):
                await task
            if self._dropping is task:
                self._dropping = None

    async def _cancel_bootstrap(self) -> None:
        task, self._bootstrap = self._bootstrap, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _release(self, parts: list[OwnedPartition]) -> None:
        if not parts:
            return
        started = time.monotonic()
        for part in parts:
            part.live = False
        ids = [
            tid
            for part in parts
            for key in part.table
            if (tid := key.decode(errors="replace")) in self._supervisor
        ]
        await asyncio.gather(*(self._supervisor.cancel(tid) for tid in ids))
        if not await self._emitter.flush(self.options.flush_timeout):
            logger.error(
                "pending sends not flushed before revocation; the next owner re-runs them",
                extra=self._log(backlog=self._emitter.backlog),
            )
        for part in parts:
            await self._checkpoint(part)
            with contextlib.suppress(CheckpointError):
                await asyncio.to_thread(self._store.release, self.defer_topic, part.number)
        await self._commit(parts)
        for part in parts:
            self._parts.pop(part.number, None)
        self._metrics.assigned_partitions.labels(queue=self.label).set(len(self._parts))
        logger.info(
            "partitions released",
            extra=self._log(
                partitions=[p.number for p in parts],
                triggers_cancelled=len(ids),
                seconds=round(time.monotonic() - started, 3),
            ),
        )

    # -- bootstrap ----------------------------------------------------------------------------

    async def _bootstrap_guarded(self, parts: list[OwnedPartition]) -> None:
        try:
            await self._bootstrap_parts(parts)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("bootstrap failed", extra=self._log(error=repr(exc)))
            self._on_fatal(BootstrapError(f"bootstrap of {self.defer_topic} failed: {exc}"))
        finally:
            _set_fetch_wait(self._consumer, self.options.fetch_max_wait_ms)

    async def _load_checkpoint(self, part: OwnedPartition) -> PartitionCheckpoint | None:
        try:
            return await asyncio.to_thread(self._store.load, self.defer_topic, part.number)
        except CheckpointError as exc:
            part.checkpointable = False
            logger.warning(
                "checkpoint unavailable; rebuilding from the topic",
                extra=self._log(part.number, error=str(exc)),
            )
            return None

    def _usable(
        self, checkpoint: PartitionCheckpoint, begin: int, end: int, resume_end: int
    ) -> str | None:
        """Why a checkpoint cannot be used, or None when it can."""
        if not begin <= checkpoint.defer_offset <= end:
            return f"defer offset {checkpoint.defer_offset} outside [{begin}, {end}]"
        if checkpoint.resume_offset > resume_end:
            return f"resume offset {checkpoint.resume_offset} beyond the end {resume_end}"
        age = time.time() - checkpoint.saved_at
        if age > self.options.checkpoint_max_age:
            return f"{age:.0f} s old (compaction may have dropped tombstones since)"
        return None

    async def _bootstrap_parts(self, parts: list[OwnedPartition]) -> None:
        started = time.monotonic()
        # A partition lost and re-acquired: its old triggers must be gone before it is rebuilt.
        await self._await_dropping()
        consumer, reader = self._consumer, self._reader
        assert consumer is not None
        assert reader is not None
        defer_tps = [p.defer_tp for p in parts]
        resume_tps = [p.resume_tp for p in parts]
        checkpoints = {p.number: await self._load_checkpoint(p) for p in parts}
        begin_d = await reader.beginning_offsets(defer_tps)
        begin_r = await reader.beginning_offsets(resume_tps)
        ends = await self._end_offsets(reader, [*defer_tps, *resume_tps])
        end_d = {tp: ends[tp] for tp in defer_tps}
        end_r = {tp: ends[tp] for tp in resume_tps}
        committed: dict[int, int] = {}
        for part in parts:
            with contextlib.suppress(KafkaError):
                committed[part.number] = (await consumer.committed(part.defer_tp)) or 0
        for part in parts:
            checkpoint = checkpoints[part.number]
            if checkpoint is not None:
                reason = self._usable(
                    checkpoint, begin_d[part.defer_tp], end_d[part.defer_tp], end_r[part.resume_tp]
                )
                if reason is not None:
                    logger.warning(
                        "checkpoint discarded: %s",
                        reason,
                        extra=self._log(part.number),
                    )
                    with contextlib.suppress(CheckpointError):
                        await asyncio.to_thread(self._store.discard, self.defer_topic, part.number)
                    checkpoint = None
                    checkpoints[part.number] = None
            if checkpoint is not None:
                part.table = checkpoint.table()
                part.saved = (checkpoint.defer_offset, checkpoint.resume_offset)
            else:
                part.table = ActiveTriggerTable(
                    defer_offset=begin_d[part.defer_tp], resume_floor=begin_r[part.resume_tp]
                )

        # 1. Fold the defer partitions from the checkpoint (or the start) to their end.
        by_defer = {p.defer_tp: p for p in parts}
        keyless: dict[int, list[Any]] = {p.number: [] for p in parts}

        def fold(tp: TopicPartition, records: Sequence[Any]) -> None:
            part = by_defer[tp]
            table = part.table
            part.read_defer += len(records)
            floor = committed.get(part.number, 0)
            for record in records:
                if record.key is None:
                    table.skip(record.offset)
                    if record.offset >= floor and record.value is not None:
                        keyless[part.number].append(record)
                else:
                    table.apply(
                        record.key, record.value, offset=record.offset, timestamp=record.timestamp
                    )

        await self._read(
            reader, {p.defer_tp: (p.table.defer_offset, end_d[p.defer_tp]) for p in parts}, fold
        )
        for part in parts:
            part.table.advance(end_d[part.defer_tp])

        # 2. Read the resume partitions past the checkpoint: a trigger whose event is there
        #    already fired (its owner died before the tombstone); it is tombstoned, not run.
        by_resume = {p.resume_tp: p for p in parts}
        emitted: dict[int, dict[bytes, int]] = {p.number: {} for p in parts}
        ranges: dict[TopicPartition, tuple[int, int]] = {}
        for part in parts:
            end = end_r[part.resume_tp]
            if not len(part.table):
                start = end
            elif checkpoints[part.number] is not None:
                start = part.table.resume_offset()
            else:
                start = await self._resume_start(reader, part, begin_r[part.resume_tp], end)
            ranges[part.resume_tp] = (max(start, begin_r[part.resume_tp]), end)

        def collect(tp: TopicPartition, records: Sequence[Any]) -> None:
            part = by_resume[tp]
            part.read_resume += len(records)
            table, found = part.table, emitted[part.number]
            for record in records:
                if record.key is not None and record.key in table:
                    found[record.key] = record.offset

        await self._read(reader, ranges, collect)
        for part in parts:
            part.table.observe_resume_end(end_r[part.resume_tp])

        # 3. Start what is left; tombstone what already fired; dead-letter bad values.
        handled = rebuilt = 0
        for part in parts:
            found = emitted[part.number]
            for key, entry in list(part.table.items()):
                offset = found.get(key)
                if offset is not None:
                    self._tombstone_only(part, key, offset)
                else:
                    self._dispatch(part, key, entry.value, entry.offset)
                    rebuilt += 1
                handled += 1
                if handled % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
            for record in keyless[part.number]:
                self._dispatch(part, None, record.value, record.offset)

        # 4. Follow the live tail from where the rebuild stopped.
        for part in parts:
            consumer.seek(part.defer_tp, part.table.defer_offset)
            part.ready = part.live = True
            self._metrics.bootstrap_records.labels(queue=self.label, topic="defer").inc(
                part.read_defer
            )
            self._metrics.bootstrap_records.labels(queue=self.label, topic="resume").inc(
                part.read_resume
            )
        if not self._paused:
            consumer.resume(*defer_tps)
        seconds = time.monotonic() - started
        self._metrics.bootstrap_seconds.labels(queue=self.label).observe(seconds)
        summary = self._summary
        if summary is not None:
            summary.triggers_rebuilt += rebuilt
            for part in parts:
                summary.paused_seconds[part.number] = time.monotonic() - self._rebalance_started
        for part in parts:
            logger.info(
                "partition bootstrapped",
                extra=self._log(
                    part.number,
                    active=len(part.table),
                    from_checkpoint=checkpoints[part.number] is not None,
                    defer_records_read=part.read_defer,
                    resume_records_read=part.read_resume,
                    already_emitted=len(emitted[part.number]),
                    seconds=round(seconds, 3),
                ),
            )
        self._bootstrap = None
        self._finish_rebalance()
        self.bootstrapped.set()

    async def _resume_start(
        self, reader: AIOKafkaConsumer, part: OwnedPartition, begin: int, end: int
    ) -> int:
        """Without a checkpoint, start the resume scan a margin before the oldest deferral."""
        oldest = part.table.oldest_timestamp()
        if oldest is None or oldest <= 0:
            return begin
        moment = max(0, oldest - int(self.options.resume_skew_margin * 1000))
        try:
            found = await reader.offsets_for_times({part.resume_tp: moment})
        except (KafkaError, ValueError) as exc:
            logger.debug("offsets_for_times failed", extra=self._log(part.number, error=repr(exc)))
            return begin
        hit = found.get(part.resume_tp)
        return end if hit is None else max(begin, int(hit.offset))

    async def _end_offsets(
        self, reader: AIOKafkaConsumer, tps: list[TopicPartition]
    ) -> dict[TopicPartition, int]:
        """The end offset of each partition now, from a fetch's high watermark.

        ListOffsets alone is not enough: Tansu answers it with the base offset of the last
        batch plus one, so records of that batch would be missed. A fetch response carries
        the true high watermark on every broker; the fetch starts at the listed end, so on
        Kafka it returns no records and costs one fetch wait.
        """
        listed = await reader.end_offsets(tps)
        reader.assign(tps)
        for tp in tps:
            reader.seek(tp, listed[tp])
        deadline = time.monotonic() + self.options.bootstrap_stall_timeout
        try:
            while any(reader.highwater(tp) is None for tp in tps):
                if time.monotonic() > deadline:
                    raise BootstrapError(f"no fetch response for {sorted(map(str, tps))}")
                await reader.getmany(timeout_ms=50)
            return {tp: max(listed[tp], int(reader.highwater(tp))) for tp in tps}
        finally:
            reader.assign([])

    async def _read(
        self,
        reader: AIOKafkaConsumer,
        ranges: dict[TopicPartition, tuple[int, int]],
        handle: Callable[[TopicPartition, Sequence[Any]], None],
    ) -> None:
        """Read each partition from its start to its end offset with batched fetches."""
        todo = {tp: span for tp, span in ranges.items() if span[0] < span[1]}
        if not todo:
            return
        reader.assign(list(todo))
        for tp, (start, _) in todo.items():
            reader.seek(tp, start)
        last_progress = time.monotonic()
        try:
            while todo:
                batches = await reader.getmany(*todo, timeout_ms=200, max_records=50_000)
                for tp, records in batches.items():
                    span = todo.get(tp)
                    if span is None or not records:
                        continue
                    if records[-1].offset >= span[1]:
                        records = [r for r in records if r.offset < span[1]]
                    handle(tp, records)
                    last_progress = time.monotonic()
                for tp in list(todo):
                    if await reader.position(tp) >= todo[tp][1]:
                        del todo[tp]
                        reader.pause(tp)
                if time.monotonic() - last_progress > self.options.bootstrap_stall_timeout:
                    raise BootstrapError(
                        f"no progress reading {sorted(str(tp) for tp in todo)} for "
                        f"{self.options.bootstrap_stall_timeout:.0f} s"
                    )
        finally:
            reader.assign([])

    # -- the live tail -------------------------------------------------------------------------

    def _apply_live(self, part: OwnedPartition, records: Sequence[Any]) -> None:
        table = part.table
        for record in records:
            if record.offset < table.defer_offset:
                continue  # already folded (redelivery after a seek)
            key, value = record.key, record.value
            if key is None:
                table.skip(record.offset)
                if value is not None:
                    self._dispatch(part, None, value, record.offset)
                continue
            table.apply(key, value, offset=record.offset, timestamp=record.timestamp)
            if value is None:
                self._on_tombstone(part, key)
            else:
                self._dispatch(part, key, value, record.offset)

    def _on_tombstone(self, part: OwnedPartition, key: bytes) -> None:
        if key in part.done:
            part.done.discard(key)
            return
        tid = key.decode(errors="replace")
        if tid in self._supervisor:
            # Someone else finished it (an earlier owner's late tombstone): stop our copy.
            logger.info(
                "trigger tombstoned elsewhere; stopping it",
                extra=self._log(part.number, trigger_id=tid),
            )
            self._cancel(tid)

    def _dispatch(self, part: OwnedPartition, key: bytes | None, value: bytes, offset: int) -> None:
        """Act on one non-tombstone value: start, cancel, or dead-letter it."""
        decision = interpret(key, value, allowed_prefixes=self._allowed, cipher=self._cipher)
        if isinstance(decision, StartTrigger):
            assert key is not None
            request = decision.request
            self._metrics.deferrals.labels(queue=self.label).inc()
            if key in part.done or request.trigger_id in self._supervisor:
                return  # the same deferral again: keep the running copy
            ref = TriggerRef(self, part.number, key, value)
            self._supervisor.add(
                request.trigger_id, decision.trigger, timeout_at=request.timeout_at, context=ref
            )
            logger.debug(
                "trigger started",
                extra=self._log(
                    part.number,
                    trigger_id=request.trigger_id,
                    task=str(request.task),
                    classpath=request.classpath,
                ),
            )
        elif isinstance(decision, CancelTrigger):
            assert key is not None
            cancel = decision.request
            self._metrics.cancel_requests.labels(queue=self.label).inc()
            if key in part.done:
                return
            part.done.add(key)
            part.table.note_emitting(key)
            if cancel.trigger_id in self._supervisor:
                self._cancel(cancel.trigger_id)
            payload = {"reason": cancel.reason}
            record = TriggerEventRecord(
                event_id=make_event_id(cancel.trigger_id, "cancelled", payload),
                trigger_id=cancel.trigger_id,
                task=cancel.task,
                defer_seq=cancel.defer_seq,
                status="cancelled",
                payload=payload,
                error=cancel.reason,
                member=self.member,
                partition=part.number,
                queue=self.queue,
            )
            logger.info(
                "trigger cancelled",
                extra=self._log(
                    part.number,
                    trigger_id=cancel.trigger_id,
                    task=str(cancel.task),
                    reason=cancel.reason,
                ),
            )
            self._submit_record(part, key, record)
        else:
            self._dead_letter(part, key, value, offset, decision)

    def _tombstone_only(self, part: OwnedPartition, key: bytes, event_offset: int) -> None:
        """The event is already on the resume topic: only the tombstone is missing."""
        part.done.add(key)
        part.table.note_emitting(key)
        part.table.note_event_offset(key, event_offset)
        logger.info(
            "trigger already emitted; writing its missing tombstone",
            extra=self._log(part.number, trigger_id=key.decode(errors="replace")),
        )
        self._emitter.submit(
            Emission(sends=(), tombstone=Send(self.defer_topic, key, None, part.number))
        )

    def _dead_letter(
        self, part: OwnedPartition, key: bytes | None, value: bytes, offset: int, bad: BadRecord
    ) -> None:
        letter = DeadLetter(
            topic=self.defer_topic,
            partition=part.number,
            offset=offset,
            key=key,
            value=value,
            error=bad.error,
            error_type=bad.error_type,
            member=self.member,
            trigger_id=bad.trigger_id,
            task=bad.task,
        )
        sends: list[Send] = [Send(self.names.dead, key, encode(letter), None)]
        logger.warning(
            "bad record dead-lettered: %s: %s",
            bad.error_type,
            bad.error,
            extra=self._log(
                part.number,
                trigger_id=bad.trigger_id,
                task=str(bad.task) if bad.task else None,
                offset=offset,
                error_type=bad.error_type,
            ),
        )
        self._metrics.dead_letters.labels(queue=self.label, reason=bad.error_type).inc()
        if key is not None:
            part.done.add(key)
            part.table.note_emitting(key)
        if bad.identified:
            assert bad.trigger_id is not None
            assert bad.task is not None
            error = f"{bad.error_type}: {bad.error}"
            payload = {"error": error}
            record = TriggerEventRecord(
                event_id=make_event_id(bad.trigger_id, "failed", payload),
                trigger_id=bad.trigger_id,
                task=bad.task,
                defer_seq=bad.defer_seq,
                status="failed",
                payload=payload,
                error=error,
                member=self.member,
                partition=part.number,
                queue=self.queue,
            )
            # A keyless record has no table entry to delete: event and letter only.
            self._submit_record(
                part, key or bad.trigger_id.encode(), record, extra=sends, tombstone=key is not None
            )
        else:
            tombstone = None if key is None else Send(self.defer_topic, key, None, part.number)
            self._emitter.submit(Emission(sends=sends, tombstone=tombstone))

    # -- outcomes -----------------------------------------------------------------------------

    def handle_outcome(self, ref: TriggerRef, outcome: TriggerOutcome) -> None:
        """An event from the supervisor (synchronous): queue it, then cancel the trigger."""
        part = self._parts.get(ref.partition)
        if part is None or part.quiesced_at is not None:
            self._hold_or_drop(part, ref, outcome)
            return
        key = ref.key
        if part is not None and key in part.done:
            self._metrics.extra_events_dropped.inc()
            if not outcome.final:
                self._cancel(outcome.trigger_id)
            return
        if part is not None:
            part.done.add(key)
            part.table.note_emitting(key)
        if not outcome.final:
            # The first event resumes the task; a multi-event trigger is stopped here.
            self._cancel(outcome.trigger_id)
        fields = request_fields(ref.value)
        direct = (
            self.options.direct_resume
            and fields.get("resume") is not None
            and outcome.status == "fired"
            and outcome.task_outcome is None
        )
        encoded = self._encoder.encode(
            fields,
            event_id=outcome.event_id,
            trigger_id=outcome.trigger_id,
            status=outcome.status,
            payload=outcome.payload,
            task_outcome=outcome.task_outcome,
            xcoms=outcome.xcoms,
            error=outcome.error,
            traceback=outcome.traceback,
            due_at=outcome.due_at,
            member=self.member,
            partition=ref.partition,
            queue=self.queue,
            resumed_directly=direct,
        )
        extra: list[Send] = []
        if direct:
            request = decode_as(ref.value, DeferRequest)
            assert request.resume is not None
            target = request.resume
            run = RunTask(
                task=request.task,
                mode="resume",
                operator=target.operator,
                op_kwargs=target.op_kwargs,
                next_method=request.next_method,
                next_kwargs=request.next_kwargs,
                event=outcome.payload,
                event_id=outcome.event_id,
                trigger_id=request.trigger_id,
                defer_seq=request.defer_seq,
                worker_queue=target.worker_queue,
                pool=target.pool,
                pool_slots=target.pool_slots,
                priority_weight=target.priority_weight,
                retries=target.retries,
            )
            extra.append(
                Send(
                    self.names.resumes(target.worker_queue),
                    request.task.ti_key.encode(),
                    encode(run),
                )
            )
        self._submit_event(
            part,
            key,
            encoded,
            _EventInfo(outcome.trigger_id, outcome.status, outcome.event_id, direct, ref.value),
            extra=extra,
            partition=ref.partition,
        )

    def _hold_or_drop(
        self, part: OwnedPartition | None, ref: TriggerRef, outcome: TriggerOutcome
    ) -> None:
        """An outcome for a partition this lane does not emit for now (rebalance)."""
        if part is not None:
            part.held.append((ref, outcome))  # emitted if the partition stays here
            return
        # Lost to another member (its trigger is being cancelled): the new owner fires it.
        logger.debug(
            "outcome of a lost partition dropped",
            extra=self._log(ref.partition, trigger_id=outcome.trigger_id),
        )

    def _submit_record(
        self,
        part: OwnedPartition | None,
        key: bytes,
        record: TriggerEventRecord,
        *,
        extra: Sequence[Send] = (),
        partition: int | None = None,
        tombstone: bool = True,
    ) -> None:
        """Queue an event built as a record (cancels, bad input: the rare paths)."""
        info = _EventInfo(
            record.trigger_id,
            record.status,
            record.event_id,
            False,
            task_key=record.task,
            seq=record.defer_seq,
        )
        self._submit_event(
            part, key, encode(record), info, extra=extra, partition=partition, tombstone=tombstone
        )

    def _submit_event(
        self,
        part: OwnedPartition | None,
        key: bytes,
        encoded: bytes,
        info: _EventInfo,
        *,
        extra: Sequence[Send],
        partition: int | None = None,
        tombstone: bool = True,
    ) -> None:
        number = part.number if part is not None else partition
        assert number is not None
        queued = _QueuedEvent(self, part, key, number, tombstone, info)
        self._emitter.submit(
            Emission(
                sends=(Send(self.resume_topic, key, encoded, number), *extra),
                tombstone=Send(self.defer_topic, key, None, number) if tombstone else None,
                on_acked=queued.acked,
                on_failed=queued.failed,
            )
        )

    def _event_acked(self, queued: _QueuedEvent, offset: int) -> None:
        info = queued.info
        current = self._parts.get(queued.number)
        if current is not None and current is queued.part:
            current.table.note_event_offset(queued.key, offset)
        counter = self._event_counters.get(info.status)
        if counter is None:
            counter = self._metrics.events.labels(queue=self.label, status=info.status)
            self._event_counters[info.status] = counter
        counter.inc()
        if info.direct:
            self._metrics.direct_resumes.labels(queue=self.label).inc()
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "trigger event produced",
                extra=self._log(
                    queued.number,
                    trigger_id=info.trigger_id,
                    task=str(info.task()),
                    status=info.status,
                    event_id=info.event_id,
                ),
            )

    def _event_failed(self, queued: _QueuedEvent, error: BaseException) -> None:
        """The event itself cannot be produced (too large, say): tell the task why instead."""
        info = queued.info
        if info.status == "failed" and info.event_id == _unproducible_id(info.trigger_id):
            return
        task = info.task()
        if task is None:
            logger.error(
                "event not producible and its task unknown",
                extra=self._log(queued.number, trigger_id=info.trigger_id, error=repr(error)),
            )
            return
        replacement = TriggerEventRecord(
            event_id=_unproducible_id(info.trigger_id),
            trigger_id=info.trigger_id,
            task=task,
            defer_seq=info.defer_seq(),
            status="failed",
            payload=_UNPRODUCIBLE,
            error=f"the trigger's event could not be produced: {error!r}",
            member=self.member,
            partition=queued.number,
            queue=self.queue,
        )
        self._submit_record(
            queued.part,
            queued.key,
            replacement,
            partition=queued.number,
            tombstone=queued.tombstone,
        )

    # -- checkpoints, commits, backpressure ------------------------------------------------

    async def _checkpoint(self, part: OwnedPartition) -> None:
        if not part.checkpointable or (not part.ready and part.saved is None):
            return
        async with part.lock:
            changes = part.table.take_changes()
            positions = (changes.defer_offset, changes.resume_offset)
            if changes.empty and positions == part.saved:
                return
            started = time.monotonic()
            try:
                await asyncio.to_thread(self._store.write, self.defer_topic, part.number, changes)
            except CheckpointError as exc:
                part.table.restore_changes(changes)
                logger.warning("checkpoint failed", extra=self._log(part.number, error=str(exc)))
                return
            part.saved = positions
            self._metrics.checkpoint_seconds.observe(time.monotonic() - started)

    async def checkpoint_all(self, *, commit: bool) -> None:
        """Checkpoint every live partition (and commit their positions)."""
        parts = [p for p in self._parts.values() if p.live]
        for part in parts:
            await self._checkpoint(part)
        if commit:
            await self._commit(parts)

    async def _commit(self, parts: Sequence[OwnedPartition]) -> None:
        """Commit read positions (informational: lag, and where keyless records were seen)."""
        consumer = self._consumer
        offsets = {p.defer_tp: p.table.defer_offset for p in parts if p.ready}
        if consumer is None or not offsets or await self._defer_topic_deleted():
            return  # (aiokafka would retry a commit to a deleted topic every 100 ms)
        if all(self._committed.get(tp) == offset for tp, offset in offsets.items()):
            return  # nothing new (an idle member commits nothing)
        try:
            # aiokafka waits for a coordinator indefinitely; a commit is only informational.
            await asyncio.wait_for(consumer.commit(offsets), self.options.flush_timeout)
        except (KafkaError, AssertionError, TimeoutError) as exc:
            logger.warning("offset commit failed", extra=self._log(error=repr(exc)))
        else:
            self._committed.update(offsets)

    async def _defer_topic_deleted(self) -> bool:
        """True once the defer topic is gone (deleted under the running member).

        Asked by name before each commit, without auto-creation: aiokafka would otherwise
        retry a commit to a deleted topic every 100 ms, and a broker may keep serving empty
        fetches for it. Reported once, at ERROR, as fatal: the member stops (exit 1) rather
        than serve a table that no longer exists; started again, it creates the topic anew
        (unless ``--no-create-topics``) and rebuilds from it.
        """
        if self._topic_deleted:
            return True
        consumer = self._consumer
        if consumer is None:
            return False
        client = consumer._client
        node = client.get_random_node()
        if node is None:
            return False
        try:
            response = await client.send(
                node, MetadataRequest([self.defer_topic], allow_auto_topic_creation=False)
            )
        except KafkaError:
            return False  # the broker cannot say now; the commit reports what it reports
        codes = [t["error_code"] for t in response.to_object()["topics"]]
        if codes != [UnknownTopicOrPartitionError.errno]:
            return False
        self._topic_deleted = True
        logger.error(
            "topic deleted under the running triggerer",
            extra=self._log(topic=self.defer_topic, group=self.group_id),
        )
        self._on_fatal(
            TopicDeletedError(
                f"topic {self.defer_topic} was deleted while the triggerer ran "
                f"(group {self.group_id}); stopping"
            )
        )
        return True

    def _apply_backpressure(self) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        load = self._supervisor.pending + self._emitter.backlog
        limit = self._max_pending
        live = [p.defer_tp for p in self._parts.values() if p.live]
        if not self._paused and load > limit:
            self._paused = True
            if live:
                consumer.pause(*live)
            self._metrics.fetch_paused.labels(queue=self.label).set(1)
            logger.info(
                "fetch paused: backlog above bound", extra=self._log(load=load, bound=limit)
            )
        elif self._paused and load <= limit // 2:
            self._paused = False
            if live:
                consumer.resume(*live)
            self._metrics.fetch_paused.labels(queue=self.label).set(0)
            logger.info("fetch resumed", extra=self._log(load=load))

    _max_pending: int = 10_000

    def set_max_pending(self, bound: int) -> None:
        """Pause fetching while pending triggers plus unsent events exceed ``bound``."""
        self._max_pending = max(1, bound)

    # -- introspection ------------------------------------------------------------------------

    def partitions(self) -> list[tuple[str, int, int, int]]:
        """``(queue, partition, active_triggers, consumer_lag)`` for the metrics."""
        consumer = self._consumer
        rows = []
        for part in self._parts.values():
            lag = 0
            if consumer is not None:
                high = consumer.highwater(part.defer_tp)
                if high is not None:
                    lag = max(0, high - part.table.defer_offset)
            rows.append((self.label, part.number, len(part.table), lag))
        return rows

    @property
    def owned(self) -> list[int]:
        """Numbers of the owned partitions."""
        return sorted(self._parts)
