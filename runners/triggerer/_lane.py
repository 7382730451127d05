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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.errors import KafkaError
from deferline.engine import BaseTrigger, TriggerSupervisor
from deferline.schemas import KwargsCipher
from deferline.topics import Settings, TopicNames, make_consumer, stop_client

from ._checkpoint import CheckpointStore
from ._emitter import Emitter
from ._events import EventEncoder
from ._fetch_wait import SHORT_WAIT_MS
from ._lane_client import _join_once, _leave_from_generation_zero
from ._lane_commits import _Commits
from ._lane_outcomes import _Outcomes
from ._lane_rebalance import _Listener, _Rebalance
from ._lane_rebuild import _Rebuild
from ._lane_tail import _Tail
from ._lane_types import (
    BootstrapError,
    LaneOptions,
    OwnedPartition,
    RebalanceSummary,
    StopTrigger,
    TopicDeletedError,
    TriggererError,
    TriggerRef,
)
from ._metrics import TriggererMetrics
from ._sticky_assignor import StickyAssignor

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


class TriggerLane(_Rebalance, _Rebuild, _Tail, _Outcomes, _Commits):
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
        self._classes: dict[str, type[BaseTrigger]] = {}
        """Trigger classes resolved under ``_allowed``, by classpath (a rebuild resolves the
        same few classpaths for every record)."""
        self._deferrals = metrics.deferrals.labels(queue=self.label)
        self._parts: dict[int, OwnedPartition] = {}
        self._topic_deleted = False
        self._committed: dict[TopicPartition, int] = {}
        self._encoder = EventEncoder()
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: AIOKafkaConsumer | None = None
        self._bootstrap: asyncio.Task[None] | None = None
        self._closing = False
        """Set by :meth:`release_all` and :meth:`close`: no rebuild starts from then on."""
        self._paused = False
        self._event_counters: dict[str, Any] = {}
        self._assignor = StickyAssignor()
        self._revoked_at: float | None = None
        self._dropping: asyncio.Task[None] | None = None
        self._summary: RebalanceSummary | None = None
        self.rebalance_log: list[RebalanceSummary] = []
        """The last rebalances of this lane (most recent last, at most 100)."""
        self.bootstrapped = asyncio.Event()

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
        await self._reader.start()
        await self._consumer.start()
        _leave_from_generation_zero(self._consumer)
        _join_once(self._consumer)
        self._consumer.subscribe([self.defer_topic], listener=_Listener(self, rebalance_ms / 2000))
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

    async def release_all(self) -> None:
        """Give up every owned partition cleanly (shutdown): flush, checkpoint, commit.

        The triggers are not cancelled here: the supervisor stops them all once the member
        has left the group, so the peers start rebuilding these partitions that much sooner
        (33,000 timers took 0.4 s to cancel). Nothing is emitted for them meanwhile: their
        partitions are no longer live, and an outcome of a partition not held is dropped.
        """
        self._closing = True
        await self._cancel_bootstrap()
        await self._await_dropping()
        await self._release(list(self._parts.values()), cancel=False)

    async def close(self) -> None:
        """Leave the group (peers take the partitions over at once) and close the reader.

        A rebuild still running is cancelled first: it reads over both clients, and a request
        of it in flight while they close would open a connection nothing closes.
        """
        self._closing = True
        await self._cancel_bootstrap()
        consumer, self._consumer = self._consumer, None
        reader, self._reader = self._reader, None
        for client in (consumer, reader):
            if client is not None:
                await stop_client(client, grace=self.options.flush_timeout, name="consumer")

    # -- backpressure ---------------------------------------------------------------------------

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
