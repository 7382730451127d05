"""A lane's rebuild of its new partitions: the reading that fills their plans (I/O), then
the tombstones of what already fired, the live tail followed, and the folded triggers
started beside it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from deferline.topics import read_log_identity, trace_receive, tracing_on

from .._aiokafka import client_of
from ._backpressure import FetchGate
from ._checkpointer import Checkpointer
from ._dispatcher import RecordDispatcher
from ._lane_types import BootstrapError, LaneOptions, OwnedPartition
from ._metrics import TriggererMetrics
from ._rebalance_recorder import RebalanceRecorder
from ._rebuild_plan import RebuildPlan, Record, Span, start_order

logger = logging.getLogger(__name__)

_START_SLICE = 0.005
"""Seconds of starting folded triggers before the loop is given back (tail, timers, I/O)."""


class Rebuilder:
    """Rebuilds a lane's new partitions and moves each to live (its book: rebuilding ->
    starting -> live); the lane runs it in a task and cancels it on revocation."""

    def __init__(
        self,
        reading: RebuildReader,
        *,
        dispatcher: RecordDispatcher,
        recorder: RebalanceRecorder,
        gate: FetchGate,
        metrics: TriggererMetrics,
        label: str,
        log: Callable[..., dict[str, Any]],
    ) -> None:
        self._reading = reading
        self._gate = gate
        self._dispatcher = dispatcher
        self._recorder = recorder
        self._metrics = metrics
        self._label = label
        self._log = log

    async def run(
        self,
        consumer: AIOKafkaConsumer,
        reader: AIOKafkaConsumer,
        parts: list[OwnedPartition],
        *,
        started: float,
    ) -> None:
        """Rebuild ``parts`` (paused in ``consumer``; resumed once they follow their tail,
        unless backpressure pauses the lane's fetching then). ``started``: when the rebuild
        began (monotonic), for its figures."""
        plans = await self._reading.read(consumer, reader, parts)
        dispatcher = self._dispatcher

        # Tombstone what already fired; dead-letter keyless values.
        for part, plan in zip(parts, plans, strict=True):
            for key, (offset, event) in plan.already_emitted():
                dispatcher.tombstone_only(part, key, offset, event)
            for offset, value in plan.keyless:
                dispatcher.dispatch(part, None, value, offset)

        # Follow the live tail from where the fold stopped, before the triggers are started:
        # a request written from here on is served at once, not after the whole partition.
        for part in parts:
            consumer.seek(part.defer_tp, part.table.defer_offset)
            part.book.follow()
            self._recorder.paused(part.number)
        if not self._gate.paused:
            consumer.resume(*(p.defer_tp for p in parts))
        live_after = time.monotonic() - started

        # Start the folded triggers beside the tail.
        rebuilt = await start_folded(plans, parts, dispatcher.dispatch, dispatcher.deferrals)

        records = self._metrics.bootstrap_records
        for part, plan in zip(parts, plans, strict=True):
            part.book.rebuilt()
            records.labels(queue=self._label, topic="defer").inc(plan.defer_read)
            records.labels(queue=self._label, topic="resume").inc(plan.resume_read)
        seconds = time.monotonic() - started
        self._metrics.bootstrap_seconds.labels(queue=self._label).observe(seconds)
        self._recorder.rebuilt(rebuilt)
        for plan in plans:
            logger.info(
                "partition bootstrapped",
                extra=self._log(
                    plan.number,
                    active=len(plan.table),
                    from_checkpoint=plan.from_checkpoint,
                    defer_records_read=plan.defer_read,
                    resume_records_read=plan.resume_read,
                    already_emitted=len(plan.emitted),
                    live_after_seconds=round(live_after, 3),
                    seconds=round(seconds, 3),
                ),
            )


class RebuildReader:
    """Reads a lane's new partitions from the checkpoint and the topics into plans.

    The rebuild reader (a consumer outside the group) reads; the group consumer is asked
    only for the committed offsets.
    """

    def __init__(
        self,
        *,
        defer_topic: str,
        resume_topic: str,
        options: LaneOptions,
        checkpointer: Checkpointer,
        prefix: str,
        group: str,
        log: Callable[..., dict[str, Any]],
    ) -> None:
        self._defer_topic = defer_topic
        self._resume_topic = resume_topic
        self._options = options
        self._prefix = prefix
        self._group = group
        self._checkpointer = checkpointer
        self._log = log

    async def read(
        self, consumer: AIOKafkaConsumer, reader: AIOKafkaConsumer, parts: list[OwnedPartition]
    ) -> list[RebuildPlan]:
        """Fold each partition's defer topic (from its checkpoint, or the start) to the end
        seen now, and find the triggers whose event is already on the resume topic."""
        defer_tps = [p.defer_tp for p in parts]
        resume_tps = [p.resume_tp for p in parts]
        topics = [self._defer_topic, self._resume_topic]
        await _learn_topics(reader, topics)
        identity = await read_log_identity(
            client_of(reader), topics, prefix=self._prefix, group=self._group
        )
        await self._checkpointer.match_log([p.number for p in parts], identity)
        begins = await reader.beginning_offsets([*defer_tps, *resume_tps])
        ends = await self._end_offsets(reader, [*defer_tps, *resume_tps])
        plans = []
        for part in parts:
            defer = Span(begin=begins[part.defer_tp], end=ends[part.defer_tp])
            resume = Span(begin=begins[part.resume_tp], end=ends[part.resume_tp])
            plan = RebuildPlan.start(
                part.number,
                defer=defer,
                resume=resume,
                # A KafkaError here fails the rebuild (loudly): a floor of 0 would
                # dead-letter every old keyless record again.
                committed=(await consumer.committed(part.defer_tp)) or 0,
                checkpoint=await self._checkpointer.restore(part, defer, resume),
            )
            part.table = plan.table
            plans.append(plan)

        # 1. Fold the defer partitions from the checkpoint (or the start) to their end.
        by_defer = {p.defer_tp: plan for p, plan in zip(parts, plans, strict=True)}
        tracing = tracing_on()

        def fold(tp: TopicPartition, records: Sequence[Any]) -> None:
            plan = by_defer[tp]
            plan.fold(records)
            for record in records if tracing else ():  # requests new to the group: a run
                if record.key is not None and record.offset >= plan.committed:
                    trace_receive(tp.topic, record.value, record.headers)

        await self._read(reader, {tp: plan.defer_range() for tp, plan in by_defer.items()}, fold)
        for plan in plans:
            plan.folded()

        # 2. Read the resume partitions past the checkpoint: a trigger whose event is there
        #    already fired (its owner died before the tombstone); it is tombstoned, not run.
        by_resume = {p.resume_tp: plan for p, plan in zip(parts, plans, strict=True)}
        ranges = {}
        for tp, plan in by_resume.items():
            found = None
            if len(plan.table) and not plan.from_checkpoint:
                found = await self._resume_start(reader, tp, plan)
            ranges[tp] = plan.resume_from(found)
        await self._read(reader, ranges, lambda tp, records: by_resume[tp].collect(records))
        for plan in plans:
            plan.collected()
        return plans

    async def _resume_start(
        self, reader: AIOKafkaConsumer, tp: TopicPartition, plan: RebuildPlan
    ) -> int | None:
        """Without a checkpoint, the resume scan starts a margin before the oldest deferral
        (None: from the start of the topic)."""
        oldest = plan.table.oldest_timestamp()
        if oldest is None or oldest <= 0:
            return None
        moment = max(0, oldest - int(self._options.resume_skew_margin * 1000))
        try:
            found = await reader.offsets_for_times({tp: moment})
        except (KafkaError, ValueError) as exc:
            logger.debug("offsets_for_times failed", extra=self._log(plan.number, error=repr(exc)))
            return None
        hit = found.get(tp)
        return plan.resume.end if hit is None else int(hit.offset)

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
        deadline = time.monotonic() + self._options.bootstrap_stall_timeout
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
        handle: Callable[[TopicPartition, Sequence[Record]], None],
    ) -> None:
        """Read each partition from its start to its end offset with batched fetches."""
        todo = {tp: span for tp, span in ranges.items() if span[0] < span[1]}
        if not todo:
            return
        reader.assign(list(todo))
        for tp, (start, _) in todo.items():
            reader.seek(tp, start)
        stall = self._options.bootstrap_stall_timeout
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
                if time.monotonic() - last_progress > stall:
                    raise BootstrapError(
                        f"no progress reading {sorted(str(tp) for tp in todo)} for {stall:.0f} s"
                    )
        finally:
            reader.assign([])


async def _learn_topics(reader: AIOKafkaConsumer, topics: list[str]) -> None:
    """Have the rebuild reader's metadata cover ``topics`` before it lists offsets.

    A reader that has not assigned a topic yet holds no metadata for it, and aiokafka
    answers an offsets request for such a partition with a retry after its backoff, once
    per topic (what that cost is in docs/benchmarks.md). Asking for the topics' metadata
    first costs one round trip. Best effort: without it the offsets request still retries.
    """
    try:
        await client_of(reader).set_topics(topics)
    except KafkaError as exc:
        logger.debug("metadata request failed", extra={"error": repr(exc)})


async def start_folded(
    plans: Sequence[RebuildPlan],
    parts: Sequence[OwnedPartition],
    dispatch: Callable[[OwnedPartition, bytes, bytes, int], bool],
    deferrals: Any,
) -> int:
    """Start the triggers folded from the topics while the partitions follow their tail.

    In :func:`start_order`; the loop is given back every few milliseconds, so the tail, due
    timers and other partitions go on while tens of thousands of triggers are decoded and
    built. The tail may have changed a key meanwhile: it is started only while the table
    still holds the record read here (same offset). A newer value was already dispatched by
    the tail; a tombstone or a cancel removed or replaced it. So the latest record per key
    wins, and a key is never started from an older record than the tail's.
    """
    by_number = {part.number: part for part in parts}
    started = count = 0
    slice_end = time.perf_counter() + _START_SLICE
    for index, (plan, key, offset) in enumerate(start_order(plans)):
        part = by_number[plan.number]
        entry = part.table.get(key)
        if entry is not None and entry.offset == offset:
            count += dispatch(part, key, entry.value, offset)
            started += 1
        if not index & 63 and time.perf_counter() > slice_end:
            deferrals.inc(count)
            count = 0
            await asyncio.sleep(0)
            slice_end = time.perf_counter() + _START_SLICE
    deferrals.inc(count)
    return started
