"""Reading topics back: a plain consumer (no group, nothing committed), assign + seek, batches.

The reader snapshots each partition's end offset the first time it reads it and stops there,
so several passes over the same topics see the same records, and a live topic does not keep
a replay running forever.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from deferline.topics import (
    BrokerError,
    Settings,
    describe_topics,
    make_consumer,
    start_client,
    stop_client,
)

from ._errors import ReplayError, TopicsNotFound
from ._records import RawRecord
from ._topics import TopicInfo, classify_topic

__all__ = ["NullProgress", "ProgressSink", "ReadBounds", "TopicReader"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReadBounds:
    """Which part of each partition to read.

    ``since``/``until`` keep records whose broker timestamp is in ``[since, until)``: reading
    starts at the offset the broker gives for ``since`` and every record is checked (brokers
    differ in how they answer a time lookup, and timestamps need not grow). ``from_offset``/
    ``to_offset`` cut every partition by offset, the cheap way to bound a huge topic; a
    negative ``from_offset`` counts back from the end (``-1000``: the last 1000).
    """

    since: dt.datetime | None = None
    until: dt.datetime | None = None
    from_offset: int | None = None
    to_offset: int | None = None

    @property
    def bounded(self) -> bool:
        return any(
            v is not None for v in (self.since, self.until, self.from_offset, self.to_offset)
        )


class ProgressSink(Protocol):
    """Where a reader reports how far it got (a rich progress bar, or nothing)."""

    def begin(self, label: str, total: int) -> None: ...

    def advance(self, records: int) -> None: ...

    def resize(self, total: int) -> None: ...

    def end(self) -> None: ...


class NullProgress:
    """Reports nowhere."""

    def begin(self, label: str, total: int) -> None:
        pass

    def advance(self, records: int) -> None:
        pass

    def resize(self, total: int) -> None:
        pass

    def end(self) -> None:
        pass


ConsumerFactory = Callable[..., AIOKafkaConsumer]


def _ms(value: dt.datetime) -> int:
    return int(value.timestamp() * 1000)


class TopicReader:
    """Streams raw records of deferline topics within bounds, in batches.

    The consumer has no group id and never commits, so production groups are untouched.

    Args:
        bounds: which part of each partition to read (default: all of it).
        batch_records: records handed out per batch at most (default 10,000).
        progress: where to report records read (default: nowhere).
        stall_timeout: seconds without a record before giving up on the partitions left.
        fetch_bytes: bytes one fetch response may carry (default 16 MiB; an eighth of it per
            partition). The fetch buffers are most of a replay's memory.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        bounds: ReadBounds | None = None,
        batch_records: int = 10_000,
        progress: ProgressSink | None = None,
        stall_timeout: float = 60.0,
        fetch_bytes: int = 16 * 1024 * 1024,
        consumer_factory: ConsumerFactory | None = None,
    ) -> None:
        self.settings = settings
        self.bounds = bounds or ReadBounds()
        self.batch_records = batch_records
        self.progress: ProgressSink = progress or NullProgress()
        self.stall_timeout = stall_timeout
        self.fetch_bytes = fetch_bytes
        self._factory = consumer_factory
        self._consumer: AIOKafkaConsumer | None = None
        self._ranges: dict[tuple[str, int], tuple[int, int]] = {}
        self._confirmed: set[tuple[str, int]] = set()
        self._topics: list[TopicInfo] | None = None
        self._partitions: dict[str, list[int]] = {}
        self.records_read = 0

    async def __aenter__(self) -> TopicReader:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._consumer is not None:
            return
        factory = self._factory or make_consumer
        consumer = factory(
            self.settings,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=50,
            # The fetch buffers are most of a replay's memory: bound them.
            fetch_max_bytes=self.fetch_bytes,
            max_partition_fetch_bytes=max(self.fetch_bytes // 8, 256 * 1024),
            client_id=f"{self.settings.client_id}-replay",
        )
        try:  # a start that fails or is cancelled closes the consumer
            await start_client(consumer, grace=5.0, name="replay reader")
        except KafkaError as exc:
            raise ReplayError(
                f"cannot connect to {self.settings.bootstrap_servers}: {exc}"
            ) from exc
        self._consumer = consumer

    async def stop(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await stop_client(consumer, grace=5.0, name="replay reader")

    @property
    def consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise ReplayError("the topic reader is not started")
        return self._consumer

    async def topics(self) -> list[TopicInfo]:
        """deferline topics under the configured prefix that exist on the cluster."""
        if self._topics is None:
            prefix = self.settings.topic_prefix
            try:
                described = await describe_topics(self.settings, prefix=prefix, configs=False)
            except BrokerError as exc:
                raise ReplayError(str(exc)) from exc
            self._topics = []
            for topic in described:
                info = classify_topic(topic.name, prefix=prefix)
                if info is not None:
                    self._topics.append(info)
                    self._partitions[info.name] = list(range(topic.partitions))
            if not self._topics:
                raise TopicsNotFound(
                    f"no deferline topic with prefix {prefix!r} on "
                    f"{self.settings.bootstrap_servers} (set DEFERLINE_TOPIC_PREFIX or "
                    "--topic-prefix)"
                )
        return self._topics

    def partitions(self, topic: str) -> list[int]:
        """Partition numbers of a topic found by :meth:`topics`."""
        return self._partitions.get(topic, [])

    async def ranges(self, topics: Iterable[TopicInfo]) -> dict[tuple[str, int], tuple[int, int]]:
        """``(start, stop)`` offsets per partition within the bounds; fixed at first call."""
        wanted = [
            TopicPartition(t.name, p)
            for t in topics
            for p in self.partitions(t.name)
            if (t.name, p) not in self._ranges
        ]
        if wanted:
            consumer = self.consumer
            begins = await consumer.beginning_offsets(wanted)
            ends = await consumer.end_offsets(wanted)
            b = self.bounds
            by_time: dict[TopicPartition, Any] = {}
            if b.since is not None:
                by_time = await consumer.offsets_for_times({tp: _ms(b.since) for tp in wanted})
            for tp in wanted:
                start, stop = begins[tp], ends[tp]
                if b.from_offset is not None:
                    start = max(
                        start, b.from_offset if b.from_offset >= 0 else stop + b.from_offset
                    )
                if b.since is not None:
                    found = by_time.get(tp)
                    start = max(start, found.offset if found is not None else stop)
                if b.to_offset is not None:
                    stop = min(stop, b.to_offset)
                self._ranges[(tp.topic, tp.partition)] = (start, max(start, stop))
        return {
            (t.name, p): self._ranges[(t.name, p)] for t in topics for p in self.partitions(t.name)
        }

    def end_offsets(self) -> dict[tuple[str, int], int]:
        """The end offsets snapshotted so far (the stop of each range without ``to_offset``)."""
        return {key: stop for key, (_, stop) in self._ranges.items()}

    async def scan(
        self,
        topics: Sequence[TopicInfo],
        *,
        label: str = "reading",
        wants: Callable[[RawRecord], bool] | None = None,
    ) -> AsyncIterator[list[RawRecord]]:
        """Yield batches of records (those ``wants`` accepts) from every partition's range."""
        consumer = self.consumer
        ranges = await self.ranges(topics)
        by_name = {t.name: t for t in topics}
        active: dict[TopicPartition, int] = {}
        for (name, partition), (start, stop) in ranges.items():
            if start < stop:
                active[TopicPartition(name, partition)] = stop
        total = sum(stop - start for start, stop in ranges.values())
        self.progress.begin(label, total)
        unconfirmed = {tp for tp in active if (tp.topic, tp.partition) not in self._confirmed}
        if not active:
            self.progress.end()
            return
        consumer.assign(list(active))
        for tp in active:
            consumer.seek(tp, ranges[(tp.topic, tp.partition)][0])
        since_ms = _ms(self.bounds.since) if self.bounds.since is not None else None
        until_ms = _ms(self.bounds.until) if self.bounds.until is not None else None
        last_progress = time.monotonic()
        try:
            while active:
                try:
                    fetched = await consumer.getmany(
                        *active, timeout_ms=200, max_records=self.batch_records
                    )
                except KafkaError as exc:
                    raise ReplayError(f"fetch failed: {exc}") from exc
                batch: list[RawRecord] = []
                seen = 0
                for tp in unconfirmed & fetched.keys():
                    total += self._confirm_end(tp, active)
                    unconfirmed.discard(tp)
                    self.progress.resize(total)
                for tp, messages in fetched.items():
                    limit = active.get(tp)
                    if limit is None:
                        continue
                    info = by_name[tp.topic]
                    for msg in messages:
                        if msg.offset >= limit:
                            del active[tp]
                            consumer.pause(tp)
                            break
                        seen += 1
                        if (since_ms is not None and msg.timestamp < since_ms) or (
                            until_ms is not None and msg.timestamp >= until_ms
                        ):
                            continue
                        raw = RawRecord(
                            info,
                            tp.partition,
                            msg.offset,
                            msg.timestamp,
                            msg.key,
                            msg.value,
                            tuple(msg.headers or ()),
                        )
                        if wants is None or wants(raw):
                            batch.append(raw)
                await self._retire_finished(active)
                if seen:
                    last_progress = time.monotonic()
                    self.records_read += seen
                    self.progress.advance(seen)
                elif time.monotonic() - last_progress > self.stall_timeout:
                    left = ", ".join(f"{tp.topic}[{tp.partition}]" for tp in active)
                    raise ReplayError(f"no progress for {self.stall_timeout:.0f} s on {left}")
                if batch:
                    yield batch
                    await asyncio.sleep(0)
        finally:
            consumer.assign([])
            self.progress.end()

    def _confirm_end(self, tp: TopicPartition, active: dict[TopicPartition, int]) -> int:
        """Raise a partition's stop to the high watermark of its first fetch; returns the rise.

        Some brokers (Tansu) answer ListOffsets(latest) with the base offset of the last
        batch plus one, short of the true end; the fetch response's high watermark is right.
        The stop is fixed after this first fetch, so later passes read the same records.
        """
        key = (tp.topic, tp.partition)
        self._confirmed.add(key)
        high: int | None = self.consumer.highwater(tp)
        start, stop = self._ranges[key]
        if high is None or high <= stop:
            return 0
        new_stop = high if self.bounds.to_offset is None else min(high, self.bounds.to_offset)
        if new_stop <= stop:
            return 0
        self._ranges[key] = (start, new_stop)
        if tp in active:
            active[tp] = new_stop
        return new_stop - stop

    async def _retire_finished(self, active: dict[TopicPartition, int]) -> None:
        """Drop partitions whose position reached their stop (gaps in compacted topics)."""
        consumer = self.consumer
        for tp, stop in list(active.items()):
            if await consumer.position(tp) >= stop:
                del active[tp]
                consumer.pause(tp)
