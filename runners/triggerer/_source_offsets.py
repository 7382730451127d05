"""The source offsets of events written outside transactions, committed once they are out.

A standing watch that reads a Kafka topic (:class:`~deferline.engine.SourcedEvent`) starts
from its consumer group's committed offsets. In a transaction the emitter commits a record's
offset with its event; without one (Tansu, ``--transactions off``) the offset may be
committed only once the event is out, here, every ``interval`` seconds: the group's offsets
for every partition whose commit point moved meanwhile, in one ``OffsetCommit`` per group,
as a member of no generation (the watch reads with manual assignment). A record is
committed only once every record submitted before it from its partition is out too, so an
event being retried holds the commit point back. A crash between the ack and the commit has
the next run read those records again: the same events, by id, which their consumer drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition
from deferline.engine import SourcePosition
from deferline.topics import Settings, make_admin

from .._aiokafka import admin_client, commit_offsets_as_no_member

__all__ = ["SourceOffsets"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Source:
    """One source partition: the offsets whose events are out, in the order submitted."""

    waiting: deque[int] = field(default_factory=deque)
    done: Counter[int] = field(default_factory=Counter)
    upto: int = -1
    """Everything below it is done (the offset to commit); -1: nothing yet."""


class SourceOffsets:
    """Commits the offsets of source records whose events are out, in the background
    (started by the first one).

    Owns ``_sources`` (per group and partition: what was submitted, what is done) and
    ``_dirty`` (the partitions whose commit point moved since the last commit), and its
    admin client. A record's offset is committed only once it and every record submitted
    before it from that partition are done: an earlier event still being retried keeps the
    commit point behind it.
    """

    def __init__(self, settings: Settings, *, interval: float = 0.5) -> None:
        self._settings = settings
        self._interval = interval
        self._sources: dict[tuple[str, TopicPartition], _Source] = {}
        self._dirty: set[tuple[str, TopicPartition]] = set()
        self._admin: Any = None
        self._task: asyncio.Task[None] | None = None
        self.commits = 0
        """OffsetCommit requests answered without error."""

    def submitted(self, source: SourcePosition) -> None:
        """An event read from ``source`` is on its way out."""
        key = (source.group, TopicPartition(source.topic, source.partition))
        self._sources.setdefault(key, _Source()).waiting.append(source.offset)

    def done(self, source: SourcePosition) -> None:
        """The event read from ``source`` is out (acked, or given up for a failure that
        stands for it): its offset + 1 is committed soon, once the earlier ones are done."""
        key = (source.group, TopicPartition(source.topic, source.partition))
        part = self._sources.get(key)
        if part is None:
            return
        part.done[source.offset] += 1
        while part.waiting and part.done[part.waiting[0]]:
            offset = part.waiting.popleft()
            part.done[offset] -= 1
            if part.upto < offset + 1:  # a record read again by a later run: not backwards
                part.upto = offset + 1
                self._dirty.add(key)
        if not part.waiting:
            part.done.clear()
        if self._dirty and self._task is None:
            self._task = asyncio.create_task(self._commit_every(), name="source-offsets")

    async def _commit_every(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.commit()

    async def commit(self) -> None:
        """Commit the partitions whose commit point moved; a group whose commit fails is
        tried again next time."""
        dirty, self._dirty = self._dirty, set()
        by_group: dict[str, dict[TopicPartition, int]] = {}
        for group, tp in dirty:
            by_group.setdefault(group, {})[tp] = self._sources[(group, tp)].upto
        for group, offsets in by_group.items():
            try:
                await self._commit(group, offsets)
                self.commits += 1
            except Exception as exc:
                logger.warning(
                    "source offsets not committed; trying again",
                    extra={"group": group, "error": repr(exc)},
                )
                self._dirty.update((group, tp) for tp in offsets)

    async def _commit(self, group: str, offsets: dict[TopicPartition, int]) -> None:
        if self._admin is None:
            admin = make_admin(self._settings)
            await admin.start()
            self._admin = admin
        await commit_offsets_as_no_member(admin_client(self._admin), group, offsets)

    async def close(self, within: float = 5.0) -> None:
        """Commit what is pending (bounded by ``within`` seconds) and close."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._dirty:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.commit(), within)
        if self._admin is not None:
            admin, self._admin = self._admin, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(admin.close(), within)
