"""A lane's checkpoints: restore one on assignment, write changes, release a partition's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from deferline.topics import LogIdentity

from ..member import DiscardedCheckpoints
from ._checkpoint import CheckpointError, CheckpointStore, PartitionCheckpoint
from ._lane_types import OwnedPartition
from ._metrics import TriggererMetrics
from ._rebuild_plan import Span, unusable

logger = logging.getLogger(__name__)


class Checkpointer:
    """The one door between a lane and its :class:`CheckpointStore` (off the loop).

    It alone writes a partition's :class:`SavePoint`. A store failure never stops the
    lane: it is logged and counted, and the partition is rebuilt from the topics next time.
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        topic: str,
        max_age: float,
        metrics: TriggererMetrics,
        log: Callable[..., dict[str, Any]],
    ) -> None:
        self._store = store
        self._topic = topic
        self._max_age = max_age
        self._metrics = metrics
        self._log = log

    async def match_log(self, numbers: list[int], identity: LogIdentity) -> None:
        """Discard the checkpoints of these partitions that cannot be restored over
        ``identity``'s log (one line per reason, those of another log counted), before any of
        them is restored."""
        await asyncio.to_thread(self._store.match_identity, self._topic, numbers, identity)

    async def restore(
        self, part: OwnedPartition, defer: Span, resume: Span
    ) -> PartitionCheckpoint | None:
        """The partition's checkpoint if there is one and it can be used (else discarded)."""
        try:
            checkpoint = await asyncio.to_thread(self._store.load, self._topic, part.number)
        except CheckpointError as exc:
            part.saved.enabled = False
            logger.warning(
                "checkpoint unavailable; rebuilding from the topic",
                extra=self._log(part.number, error=str(exc)),
            )
            return None
        if checkpoint is None:
            return None
        reason = unusable(checkpoint, defer, resume, now=time.time(), max_age=self._max_age)
        if reason is not None:
            discards = DiscardedCheckpoints(self._topic)
            discards.add(part.number, reason)
            discards.report(**self._log(part.number))
            await self._quietly(self._store.discard, part.number, "discard")
            return None
        part.saved.positions = (checkpoint.defer_offset, checkpoint.resume_offset)
        return checkpoint

    async def save(self, part: OwnedPartition, *, rebuilt: bool) -> None:
        """Write what changed in the partition's table (a partition not ``rebuilt`` only
        when it was restored from a checkpoint: its table is a checkpoint's, then)."""
        saved = part.saved
        if not saved.enabled or (not rebuilt and saved.positions is None):
            return
        async with saved.lock:
            changes = part.table.take_changes()
            positions = (changes.defer_offset, changes.resume_offset)
            if changes.empty and positions == saved.positions:
                return
            started = time.monotonic()
            try:
                await asyncio.to_thread(self._store.write, self._topic, part.number, changes)
            except CheckpointError as exc:
                part.table.restore_changes(changes)
                self._metrics.checkpoint_failures.labels(action="write").inc()
                logger.warning("checkpoint failed", extra=self._log(part.number, error=str(exc)))
                return
            saved.positions = positions
            self._metrics.checkpoint_seconds.observe(time.monotonic() - started)

    async def release(self, number: int) -> None:
        """Close the partition's checkpoint (it stays on disk for a later assignment)."""
        await self._quietly(self._store.release, number, "release")

    async def _quietly(self, call: Callable[[str, int], None], number: int, action: str) -> None:
        """Run a store call off the loop; a failure is logged and counted, not raised."""
        try:
            await asyncio.to_thread(call, self._topic, number)
        except CheckpointError as exc:
            self._metrics.checkpoint_failures.labels(action=action).inc()
            logger.warning("checkpoint %s failed", action, extra=self._log(number, error=str(exc)))
