"""The console's one reader of records: every deferline topic, from the start, then live.

A plain consumer (no group, nothing committed, as the replay reader): production groups are
untouched and the brokers see one more fetcher. History is read first (the status says how
far), then records are folded as they arrive. The topics are listed again now and then, so a
queue added later is followed too.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.replay import RawRecord, TopicInfo, TopicsNotFound, classify_topic
from deferline.topics import (
    Settings,
    TopicNames,
    describe_topics,
    make_consumer,
    start_client,
    stop_client,
)

from ._feed import RecordFeed
from ._status import ConsoleState, ConsoleStatus

__all__ = ["TopicTail", "list_topics"]

logger = logging.getLogger(__name__)

_RELIST_S = 30.0


async def list_topics(settings: Settings) -> dict[str, tuple[TopicInfo, int]]:
    """deferline topics under the prefix, with their partition counts.

    Kafka hides topics a principal may not describe, so when none is listed the tasks topic
    is asked for by name: a refusal then says so instead of looking like an empty cluster.
    """
    prefix = settings.topic_prefix
    found: dict[str, tuple[TopicInfo, int]] = {}
    for topic in await describe_topics(settings, prefix=prefix, configs=False):
        info = classify_topic(topic.name, prefix=prefix)
        if info is not None:
            found[info.name] = (info, topic.partitions)
    if not found:
        await describe_topics(settings, [TopicNames(prefix).tasks], configs=False)
        raise TopicsNotFound(f"no deferline topic with prefix {prefix!r}")
    return found


class TopicTail:
    """Reads every deferline topic into ``feed`` until cancelled; reports through ``status``."""

    def __init__(self, settings: Settings, feed: RecordFeed, status: ConsoleStatus) -> None:
        self._settings = settings
        self._feed = feed
        self._status = status
        self.topics: dict[str, tuple[TopicInfo, int]] = {}
        self.end_offsets: dict[tuple[str, int], int] = {}
        self.fetch_bytes = 0

    async def run(self) -> None:
        """Read, and after a failure say why, wait and read again (never returns)."""
        said, said_at = "", float("-inf")
        while True:
            try:
                await self._read()
            except Exception as exc:  # every failure is shown on the page, then retried
                now = asyncio.get_running_loop().time()
                if str(exc) != said or now - said_at > 60.0:  # the same once a minute
                    said, said_at = str(exc), now
                    logger.warning("console cannot read the cluster: %s", exc)
                self._status.fail(exc)
            await asyncio.sleep(2.0)
            self._status.move(ConsoleState.CONNECTING, self._status.message)

    async def _read(self) -> None:
        self.topics = await list_topics(self._settings)
        consumer = make_consumer(
            self._settings,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=200,
            client_id=f"{self._settings.client_id}-console",
        )
        try:  # stopped even if its start fails or is cancelled (it holds connections)
            await start_client(consumer, grace=5.0, name="console reader")
            await self._follow(consumer)
        finally:
            await stop_client(consumer, grace=5.0, name="console reader")

    async def _assign(self, consumer: AIOKafkaConsumer) -> None:
        """Follow every partition of the topics listed; a new one is read from its start.

        ``assign`` forgets every position, so the partitions already followed are sought
        back to where they were (else the whole history would be read again).
        """
        current = set(consumer.assignment())
        wanted = {TopicPartition(t, p) for t, (_, n) in self.topics.items() for p in range(n)}
        new = sorted(wanted - current, key=lambda tp: (tp.topic, tp.partition))
        if not new:
            return
        kept = {tp: await consumer.position(tp) for tp in current & wanted}
        consumer.assign(sorted(wanted, key=lambda tp: (tp.topic, tp.partition)))
        for tp, position in kept.items():
            consumer.seek(tp, position)
        await consumer.seek_to_beginning(*new)

    async def _follow(self, consumer: AIOKafkaConsumer) -> None:
        await self._assign(consumer)
        tps = list(consumer.assignment())
        target = {tp: end for tp, end in (await consumer.end_offsets(tps)).items() if end > 0}
        total = max(1, sum(target.values()))
        self._status.move(ConsoleState.CATCHING_UP, "reading the topics' history")
        relisted = time.monotonic()
        while True:
            batches = await consumer.getmany(timeout_ms=500, max_records=5000)
            for tp, messages in batches.items():
                info = self.topics[tp.topic][0]
                for msg in messages:
                    self.fetch_bytes += len(msg.value or b"") + len(msg.key or b"")
                    self._feed.feed(
                        RawRecord(
                            info,
                            tp.partition,
                            msg.offset,
                            msg.timestamp,
                            msg.key,
                            msg.value,
                        )
                    )
            for tp in tps:
                high = consumer.highwater(tp)
                if high is not None:
                    self.end_offsets[(tp.topic, tp.partition)] = high
            if target:
                left = 0
                for tp, end in list(target.items()):
                    # Some brokers (Tansu) answer ListOffsets short of the true end; the
                    # fetch responses' high watermark is right.
                    end = target[tp] = max(end, consumer.highwater(tp) or 0)
                    position = await consumer.position(tp)
                    if position >= end:
                        del target[tp]
                    else:
                        left += end - position
                self._status.progress = round(1 - left / total, 3)
            elif self._status.state is ConsoleState.CATCHING_UP:
                self._feed.loop.rebase()
                self._status.move(ConsoleState.LIVE, "live")
            if time.monotonic() - relisted > _RELIST_S:
                relisted = time.monotonic()
                self.topics = await list_topics(self._settings)
                await self._assign(consumer)
                tps = list(consumer.assignment())
            await asyncio.sleep(0)
