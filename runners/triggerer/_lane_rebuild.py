"""Rebuilding a lane's new partitions from the checkpoint and the compacted defer topic."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from deferline.topics import read_log_identity, trace_receive

from ._checkpoint import CheckpointError, PartitionCheckpoint
from ._lane_client import _learn_topics, _set_fetch_wait
from ._lane_state import _LaneCore
from ._lane_types import BootstrapError, OwnedPartition
from ._partition_table import ActiveTriggerTable

logger = logging.getLogger(__name__)

_START_SLICE = 0.005
"""Seconds of starting folded triggers before the loop is given back (tail, timers, I/O)."""


class _Rebuild(_LaneCore):
    """Partition rebuild of a :class:`TriggerLane` (a part of it, not used alone)."""

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
        identity = await read_log_identity(
            reader._client,
            [self.defer_topic, self.resume_topic],
            prefix=self.settings.topic_prefix,
            group=self.group_id,
        )
        await asyncio.to_thread(
            self._store.match_identity, self.defer_topic, [p.number for p in parts], identity
        )
        checkpoints = {p.number: await self._load_checkpoint(p) for p in parts}
        await _learn_topics(reader, [self.defer_topic, self.resume_topic])
        begins = await reader.beginning_offsets([*defer_tps, *resume_tps])
        begin_d = {tp: begins[tp] for tp in defer_tps}
        begin_r = {tp: begins[tp] for tp in resume_tps}
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
                    if record.offset >= floor:  # not seen by the group before
                        trace_receive(tp.topic, record.value, record.headers)

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

        # 3. Tombstone what already fired; dead-letter keyless values.
        for part in parts:
            table, found = part.table, emitted[part.number]
            for key, offset in found.items():
                if key in table:
                    self._tombstone_only(part, key, offset)
            for record in keyless[part.number]:
                self._dispatch(part, None, record.value, record.offset)

        # 4. Follow the live tail from where the fold stopped, before the triggers are started:
        #    a request written from here on is served at once, not after the whole partition.
        for part in parts:
            consumer.seek(part.defer_tp, part.table.defer_offset)
            part.live = True
        if not self._paused:
            consumer.resume(*defer_tps)
        summary = self._summary
        if summary is not None:
            for part in parts:
                summary.paused_seconds[part.number] = time.monotonic() - self._rebalance_started
        live_after = time.monotonic() - started

        # 5. Start the folded triggers beside the tail (see _start_folded).
        rebuilt = await self._start_folded(parts, emitted, committed)

        for part in parts:
            part.ready = True
            self._metrics.bootstrap_records.labels(queue=self.label, topic="defer").inc(
                part.read_defer
            )
            self._metrics.bootstrap_records.labels(queue=self.label, topic="resume").inc(
                part.read_resume
            )
        seconds = time.monotonic() - started
        self._metrics.bootstrap_seconds.labels(queue=self.label).observe(seconds)
        if summary is not None:
            summary.triggers_rebuilt += rebuilt
            summary.rebuilt_at = time.time()
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
                    live_after_seconds=round(live_after, 3),
                    seconds=round(seconds, 3),
                ),
            )
        self._bootstrap = None
        self._finish_rebalance()
        self.bootstrapped.set()

    async def _start_folded(
        self,
        parts: list[OwnedPartition],
        emitted: dict[int, dict[bytes, int]],
        committed: dict[int, int],
    ) -> int:
        """Start the triggers folded from the topics while the partitions follow their tail.

        First the records at or past the partition's committed offset (the previous owner
        commits when it quiesces, so no member has served these: a request written during
        the rebalance waits there), then the rest; each group in log order, so timers that
        are already due fire in the order they were deferred. The loop is given back every
        few milliseconds, so the tail, due timers and other partitions go on while tens of
        thousands of triggers are decoded and built.

        The tail may have changed a key meanwhile: it is started only while the table still
        holds the record read here (same offset). A newer value was already dispatched by
        the tail; a tombstone or a cancel removed or replaced it. So the latest record per
        key wins, and a key is never started from an older record than the tail's.
        """
        todo = [
            (entry.offset < committed.get(part.number, 0), entry.offset, part, key)
            for part in parts
            for key, entry in part.table.items()
            if key not in emitted[part.number]
        ]
        todo.sort(key=lambda item: (item[0], item[1]))
        started = deferrals = 0
        slice_end = time.perf_counter() + _START_SLICE
        for index, (_, offset, part, key) in enumerate(todo):
            entry = part.table.get(key)
            if entry is not None and entry.offset == offset:
                deferrals += self._dispatch(part, key, entry.value, offset)
                started += 1
            if not index & 63 and time.perf_counter() > slice_end:
                self._deferrals.inc(deferrals)
                deferrals = 0
                await asyncio.sleep(0)
                slice_end = time.perf_counter() + _START_SLICE
        self._deferrals.inc(deferrals)
        return started

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
