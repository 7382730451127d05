"""The source offsets of events written outside transactions, committed once acked.

A standing watch that reads a Kafka topic (:class:`~deferline.engine.SourcedEvent`) starts
from its consumer group's committed offsets. In a transaction the emitter commits a record's
offset with its event; without one (Tansu, ``--transactions off``) the offset may be
committed only once the event is acked, here, every ``interval`` seconds: the group's
offsets for every partition whose events were acked meanwhile, in one ``OffsetCommit`` per
group, as a member of no generation (the watch reads with manual assignment). A crash
between the ack and the commit has the next run read those records again: the same events,
by id, which their consumer drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import for_code
from aiokafka.protocol.commit import OffsetCommitRequest
from deferline.engine import SourcePosition
from deferline.topics import Settings, make_admin

__all__ = ["SourceOffsets"]

logger = logging.getLogger(__name__)


class SourceOffsets:
    """Commits acked source offsets in the background (started by the first one).

    Owns ``_pending`` (the highest acked offset + 1 per group and partition, not committed
    yet) and its admin client.
    """

    def __init__(self, settings: Settings, *, interval: float = 0.5) -> None:
        self._settings = settings
        self._interval = interval
        self._pending: dict[str, dict[TopicPartition, int]] = {}
        self._admin: Any = None
        self._task: asyncio.Task[None] | None = None
        self.commits = 0
        """OffsetCommit requests answered without error."""

    def acked(self, source: SourcePosition) -> None:
        """The event read from ``source`` is acked: commit its offset + 1 soon."""
        group = self._pending.setdefault(source.group, {})
        tp = TopicPartition(source.topic, source.partition)
        if source.offset + 1 > group.get(tp, -1):
            group[tp] = source.offset + 1
        if self._task is None:
            self._task = asyncio.create_task(self._commit_every(), name="source-offsets")

    async def _commit_every(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.commit()

    async def commit(self) -> None:
        """Commit what is pending; what fails stays pending (tried again next time)."""
        pending, self._pending = self._pending, {}
        for group, offsets in pending.items():
            try:
                await self._commit(group, offsets)
                self.commits += 1
            except Exception as exc:
                logger.warning(
                    "source offsets not committed; trying again",
                    extra={"group": group, "error": repr(exc)},
                )
                mine = self._pending.setdefault(group, {})
                for tp, offset in offsets.items():
                    mine[tp] = max(offset, mine.get(tp, -1))

    async def _commit(self, group: str, offsets: dict[TopicPartition, int]) -> None:
        if self._admin is None:
            admin = make_admin(self._settings)
            await admin.start()
            self._admin = admin
        topics: dict[str, list[tuple[int, int, str]]] = {}
        for tp, offset in sorted(offsets.items()):
            topics.setdefault(tp.topic, []).append((tp.partition, offset, ""))
        coordinator = await self._admin.find_coordinator(group)
        request = OffsetCommitRequest(
            group,
            OffsetCommitRequest.DEFAULT_GENERATION_ID,
            "",
            OffsetCommitRequest.DEFAULT_RETENTION_TIME,
            list(topics.items()),
        )
        response = await self._admin._send_request(request, coordinator)
        for _topic, partitions in response.topics:
            for _partition, error_code in partitions:
                if error_code:
                    raise for_code(error_code)(f"OffsetCommit for group {group}")

    async def close(self, within: float = 5.0) -> None:
        """Commit what is pending (bounded by ``within`` seconds) and close."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.commit(), within)
        if self._admin is not None:
            admin, self._admin = self._admin, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(admin.close(), within)
