"""Rebalances of a lane: quiesce on revocation; keep, drop or rebuild on assignment."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

from aiokafka import ConsumerRebalanceListener, TopicPartition

from ._checkpoint import CheckpointError
from ._fetch_wait import SHORT_WAIT_MS
from ._lane_client import _set_fetch_wait
from ._lane_state import _LaneCore
from ._lane_types import OwnedPartition, RebalanceSummary

logger = logging.getLogger(__name__)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Rebalance callbacks of one lane, as aiokafka's listener object.

    aiokafka rejoins only once the revocation callback returns, and the whole group waits
    for that rejoin (up to the rebalance timeout, then without this member): so the
    quiesce is bounded by ``within`` seconds. Cut short, it has already stopped emitting
    for the revoked partitions (its first step); what it did not flush, checkpoint or
    commit the next owner redoes from the topics.
    """

    def __init__(self, lane: _Rebalance, within: float) -> None:
        self._lane = lane
        self._within = within

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        revoked = set(revoked)
        try:
            await asyncio.wait_for(self._lane.on_partitions_revoked(revoked), self._within)
        except TimeoutError:
            logger.error(
                "revocation not quiesced within %.0f s; rejoining the group anyway",
                self._within,
                extra=self._lane._log(),
            )
            self._lane.drop_unready(revoked)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._lane.on_partitions_assigned(set(assigned))


class _Rebalance(_LaneCore):
    """Rebalance handling of a :class:`TriggerLane` (a part of it, not used alone)."""

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
        if consumer is None or self._closing:
            # Shutting down: an assignment that arrives while this member releases its
            # partitions (a peer left or joined meanwhile) is not served; the peers take
            # it over once this member has left.
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
        summary.triggers_cancelled = self._forget(lost)

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

    def _forget(self, parts: list[OwnedPartition]) -> int:
        """Forget ``parts`` now and cancel their triggers in the background, without
        emitting (a rebuild waits for that); the number of triggers cancelled."""
        cancelled: list[str] = []
        for part in parts:
            self._parts.pop(part.number, None)
            part.held.clear()
            cancelled.extend(
                tid
                for key in part.table
                if (tid := key.decode(errors="replace")) in self._supervisor
            )
        if parts:
            previous = self._dropping
            self._dropping = asyncio.create_task(
                self._drop(previous, parts, cancelled), name="drop-lost-partitions"
            )
        return len(cancelled)

    def drop_unready(self, revoked: set[TopicPartition]) -> None:
        """After a revocation cut short: forget the revoked partitions that were not ready
        (their rebuild or release interrupted), so the next assignment rebuilds them
        rather than keep them half-built. Ready ones stay: kept, they resume; lost, dropped."""
        self._forget(
            [
                part
                for tp in revoked
                if tp.topic == self.defer_topic
                and (part := self._parts.get(tp.partition)) is not None
                and not part.ready
            ]
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
        await self._supervisor.cancel_many(trigger_ids)
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

    async def _release(self, parts: list[OwnedPartition], *, cancel: bool = True) -> None:
        """Stop emitting for ``parts``, flush, checkpoint, commit and forget them; with
        ``cancel``, their triggers are cancelled first (else the caller stops them)."""
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
        if cancel:
            await self._supervisor.cancel_many(ids)
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
                triggers_cancelled=len(ids) if cancel else 0,
                seconds=round(time.monotonic() - started, 3),
            ),
        )
