"""A lane's checkpoints and offset commits, and the deleted-topic check before each commit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from aiokafka.errors import KafkaError, UnknownTopicOrPartitionError
from aiokafka.protocol.metadata import MetadataRequest

from ._checkpoint import CheckpointError
from ._lane_state import _LaneCore
from ._lane_types import OwnedPartition, TopicDeletedError

logger = logging.getLogger(__name__)


class _Commits(_LaneCore):
    """Checkpoints and commits of a :class:`TriggerLane` (a part of it, not used alone)."""

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
        # Asked over the rebuild reader's connections when it runs: the group consumer's
        # fetch connection usually holds a long poll (500 ms on Apache Kafka), and a broker
        # answers one connection's requests in order, so every revocation and every leaver's
        # last commit waited for it. The reader's fetches, when it has any, wait 20 ms.
        client = (self._reader or consumer)._client
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
