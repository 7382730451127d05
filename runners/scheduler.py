"""The scheduler: folds trigger events into task state and sends resumed tasks to workers.

It reads two streams into one :class:`~deferline.engine.TaskTable`:

- the compacted **tasks** topic, every partition, from the beginning, without a consumer
  group: it *is* the state (clients, workers and the scheduler itself write it), so a
  (re)started scheduler folds it to the end before deciding anything;
- every partition of every **resume** topic (``resume`` and ``resume.<queue>``, found by
  name), with offsets kept in the consumer group ``<prefix>scheduler``: committed only once
  what they caused is published, and never past an event still held pending.

Decisions go out as records: TaskStateRecords to the tasks topic (key ``ti_key``), RunTasks
to ``queue[.<wq>]`` (new work) or ``queue[.<wq>].resumes`` (resumes, which workers read
first), CancelRequests to ``defer[.<queue>]``. For one task the state record is acknowledged
before its RunTask is sent, so a worker's "running" always lands after "queued".

Plain aiokafka rather than faust tables: the tasks topic is written by several parties and is
already the changelog; pools are global (admission needs every task of a pool in one place);
and the event→task join needs no repartition topic when one process reads both topics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import click
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from deferline.engine import Emit, Pools, TaskTable
from deferline.schemas import (
    CancelRequest,
    DeadLetter,
    DeferlineError,
    RunTask,
    SchemaError,
    TaskStateRecord,
    TriggerEventRecord,
    decode,
    encode,
)
from deferline.topics import (
    Settings,
    TopicNames,
    ensure_topics,
    make_consumer,
    make_producer,
    topic_specs,
)
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._metrics import MetricsServer
from ._options import connection_options, layout_options, logging_options

__all__ = ["Scheduler", "SchedulerError", "scheduler_command"]

logger = logging.getLogger(__name__)


class SchedulerError(DeferlineError):
    """The scheduler could not read or publish (broker unreachable, topic missing...)."""


class Scheduler:
    """Fold the tasks and resume topics into task state; publish decisions.

    Args:
        settings: connection and topic layout.
        pools: slot counts per pool (default: ``default_pool`` with 128 slots, like Airflow).
        worker_queues: worker queues whose topics are created at start; others are created
            the first time a task names them.
        group_id: consumer group of the resume topics; default ``<prefix>scheduler``.
        metrics_port: serve Prometheus metrics on this port (0: any free port; None: off).
        orphan_check_interval: how often events held pending are checked against the tasks
            topic's end; one that still has no deferral once the scheduler has read past it
            is dropped as an orphan (for instance a DeferRequest published by another system).
        commit_interval: seconds between offset commits of the resume topics.
        topic_refresh_interval: seconds between looks for new ``resume.<queue>`` topics.
        max_records: most records folded per fetch.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        pools: Pools | Mapping[str, int] | None = None,
        worker_queues: Sequence[str] = (),
        group_id: str | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",
        orphan_check_interval: float = 5.0,
        commit_interval: float = 1.0,
        topic_refresh_interval: float = 10.0,
        max_records: int = 2000,
    ) -> None:
        if isinstance(pools, Mapping):
            pools = Pools(slots=dict(pools))
        self.settings = settings
        self.names = TopicNames(settings.topic_prefix)
        self.table = TaskTable(pools=pools)
        self.group_id = group_id or f"{settings.topic_prefix}scheduler"
        self.orphan_check_interval = orphan_check_interval
        self.commit_interval = commit_interval
        self.max_records = max_records
        self.topic_refresh_interval = topic_refresh_interval
        self._resume_pattern = re.compile(
            f"^{re.escape(settings.topic_prefix)}resume(\\.[A-Za-z0-9_-]+)?$"
        )
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(self))
        self._metrics = (
            MetricsServer(self.registry, host=metrics_host, port=metrics_port)
            if metrics_port is not None
            else None
        )
        self._worker_queues = {"default", *worker_queues}
        self._ensured_worker_queues: set[str] = set()
        self._producer: AIOKafkaProducer | None = None
        self._tasks: AIOKafkaConsumer | None = None
        self._events: AIOKafkaConsumer | None = None
        self._task_tps: list[TopicPartition] = []
        self._tasks_pos: dict[TopicPartition, int] = {}
        self._tasks_moved = asyncio.Event()
        self._events_done: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}
        self._publish_lock = asyncio.Lock()
        self._main: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self.recovered_records = 0
        self.recovery_seconds: float | None = None
        self.bad_records = 0
        self.published = 0
        self.lag: dict[str, int] = {"tasks": 0, "events": 0}

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Scheduler:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def metrics_port(self) -> int | None:
        """The port metrics are served on, once started."""
        return self._metrics.port if self._metrics is not None else None

    @property
    def ready(self) -> bool:
        """True once the tasks topic is folded and the resume topics are being read."""
        return self._ready.is_set()

    async def wait_ready(self) -> None:
        """Wait until :attr:`ready`; raises if the scheduler failed first."""
        waiter = asyncio.ensure_future(self._ready.wait())
        watch: set[asyncio.Future[Any]] = {waiter}
        if self._main is not None:
            watch.add(self._main)
        try:
            done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if self._main is not None and self._main in done:
            await self._main  # raises its error
            raise SchedulerError("the scheduler stopped before it was ready")

    async def start(self) -> None:
        """Create missing topics, connect, and start folding (returns before catch-up)."""
        if self._main is not None:
            return
        try:
            await ensure_topics(
                self.settings, topic_specs(self.settings, worker_queues=self._worker_queues)
            )
            self._ensured_worker_queues |= self._worker_queues
            if self._metrics is not None:
                await self._metrics.start()
            self._producer = make_producer(self.settings)
            await self._producer.start()
            self._tasks = make_consumer(self.settings, group_id=None, max_poll_records=None)
            await self._tasks.start()
        except KafkaError as exc:
            await self._close()
            raise SchedulerError(f"cannot connect the scheduler: {exc}") from exc
        except BaseException:
            await self._close()
            raise
        self._main = asyncio.create_task(self._run(), name="deferline-scheduler")

    async def stop(self) -> None:
        """Stop reading, commit what is published, disconnect. Idempotent."""
        main, self._main = self._main, None
        if main is not None:
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await main
        await self._close()

    async def wait(self) -> None:
        """Run until stopped; raises if a loop fails."""
        if self._main is not None:
            await self._main

    async def _close(self) -> None:
        events, self._events = self._events, None
        if events is not None:
            with contextlib.suppress(KafkaError, SchedulerError):
                await self._commit(events)
            await events.stop()
        tasks, self._tasks = self._tasks, None
        if tasks is not None:
            await tasks.stop()
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()
        if self._metrics is not None:
            await self._metrics.stop()
        self._ready.clear()

    # -- loops ----------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._recover()
            async with self._publish_lock:
                await self._publish(self.table.drain())
            self._events = make_consumer(
                self.settings, group_id=self.group_id, max_poll_records=None
            )
            await self._events.start()
            await self._follow_resume_topics()
            async with asyncio.TaskGroup() as group:
                group.create_task(self._tasks_loop(), name="scheduler-tasks")
                group.create_task(self._events_loop(), name="scheduler-events")
                group.create_task(self._housekeeping_loop(), name="scheduler-housekeeping")
                self._ready.set()
                logger.info(
                    "scheduler ready",
                    extra={
                        "tasks": len(self.table),
                        "recovered_records": self.recovered_records,
                        "recovery_seconds": self.recovery_seconds,
                        "group_id": self.group_id,
                    },
                )
        except KafkaError as exc:
            raise SchedulerError(f"scheduler lost the broker: {exc}") from exc

    async def _recover(self) -> None:
        """Fold the whole tasks topic, up to its end as of now, before deciding anything."""
        assert self._tasks is not None
        began = time.monotonic()
        partitions = await self._tasks_partitions()
        self._task_tps = [TopicPartition(self.names.tasks, p) for p in sorted(partitions)]
        self._tasks.assign(self._task_tps)
        await self._tasks.seek_to_beginning(*self._task_tps)
        ends = await self._tasks.end_offsets(self._task_tps)
        for tp in self._task_tps:
            self._tasks_pos[tp] = await self._tasks.position(tp)
        while any(self._tasks_pos[tp] < ends[tp] for tp in self._task_tps):
            batches = await self._tasks.getmany(timeout_ms=200, max_records=self.max_records)
            for tp, messages in batches.items():
                for message in messages:
                    self._fold_task(message.key, message.value, live=False)
                    self.recovered_records += 1
                if messages:
                    self._tasks_pos[tp] = messages[-1].offset + 1
        self.recovery_seconds = time.monotonic() - began

    async def _tasks_partitions(self) -> set[int]:
        assert self._tasks is not None
        deadline = time.monotonic() + 30.0
        while True:
            partitions = self._tasks.partitions_for_topic(self.names.tasks)
            if partitions:
                return set(partitions)
            if time.monotonic() > deadline:
                raise SchedulerError(f"topic {self.names.tasks} has no partitions")
            await self._tasks._client.force_metadata_update()

    async def _tasks_loop(self) -> None:
        assert self._tasks is not None
        while True:
            batches = await self._tasks.getmany(timeout_ms=500, max_records=self.max_records)
            dead: list[DeadLetter] = []
            for tp, messages in batches.items():
                for message in messages:
                    bad = self._fold_task(message.key, message.value, live=True)
                    if bad is not None:
                        dead.append(self._dead(message, bad))
                if messages:
                    self._tasks_pos[tp] = messages[-1].offset + 1
            async with self._publish_lock:
                await self._publish(self.table.drain(), dead)
            self._tasks_moved.set()

    async def _events_loop(self) -> None:
        assert self._events is not None
        last_commit = last_refresh = time.monotonic()
        while True:
            batches = await self._events.getmany(timeout_ms=500, max_records=self.max_records)
            dead: list[DeadLetter] = []
            read: dict[TopicPartition, int] = {}
            for tp, messages in batches.items():
                for message in messages:
                    bad = self._fold_event(message.value, ref=(tp, message.offset))
                    if bad is not None:
                        dead.append(self._dead(message, bad))
                if messages:
                    read[tp] = messages[-1].offset + 1
            async with self._publish_lock:
                await self._publish(self.table.drain(), dead)
            # Only now is everything these events caused acknowledged: they may be committed.
            self._events_done.update(read)
            now = time.monotonic()
            if now - last_commit >= self.commit_interval:
                await self._commit(self._events)
                last_commit = now
            if now - last_refresh >= self.topic_refresh_interval:
                await self._follow_resume_topics()
                last_refresh = now

    async def _follow_resume_topics(self) -> None:
        """Read every partition of every resume topic (``resume``, ``resume.<queue>``).

        Partitions are assigned by hand, not through a group rebalance: the scheduler is one
        process that must see every event (pools are global), and it joins no group, so a
        restart starts reading at once. The group id only keeps the committed offsets.
        """
        events = self._events
        assert events is not None
        cluster = await events._client.fetch_all_metadata()
        wanted = {
            TopicPartition(topic, partition)
            for topic in cluster.topics()
            if self._resume_pattern.match(topic)
            for partition in cluster.partitions_for_topic(topic) or ()
        }
        current = set(events.assignment())
        if wanted <= current:
            return
        positions = {tp: await events.position(tp) for tp in current}
        events.assign(sorted(wanted | current))
        for tp, offset in positions.items():
            events.seek(tp, offset)
        logger.info(
            "reading resume partitions",
            extra={
                "group_id": self.group_id,
                "added": sorted(f"{tp.topic}:{tp.partition}" for tp in wanted - current),
            },
        )

    async def _housekeeping_loop(self) -> None:
        """Drop events that can never apply, and refresh lag figures."""
        assert self._tasks is not None
        while True:
            await asyncio.sleep(self.orphan_check_interval)
            generation = self.table.mark_generation()
            ends = await self._tasks.end_offsets(self._task_tps)
            while any(self._tasks_pos.get(tp, 0) < end for tp, end in ends.items()):
                self._tasks_moved.clear()
                await self._tasks_moved.wait()
            self.lag["tasks"] = sum(
                max(0, ends[tp] - self._tasks_pos.get(tp, 0)) for tp in self._task_tps
            )
            dropped = self.table.expire_pending(generation)
            if dropped:
                logger.warning(
                    "events without a deferral on the tasks topic dropped",
                    extra={"count": dropped},
                )
            await self._refresh_events_lag()

    async def _refresh_events_lag(self) -> None:
        events = self._events
        if events is None:
            return
        assigned = list(events.assignment())
        if not assigned:
            self.lag["events"] = 0
            return
        ends = await events.end_offsets(assigned)
        self.lag["events"] = sum(
            max(0, ends[tp] - self._events_done.get(tp, self._committed.get(tp, ends[tp])))
            for tp in assigned
        )

    # -- folding and publishing -------------------------------------------------------------

    def _fold_task(self, key: bytes | None, value: bytes | None, *, live: bool) -> str | None:
        if value is None:
            if key is not None:
                self.table.forget(key.decode("utf-8", "replace"))
            return None
        try:
            record = decode(value)
        except SchemaError as exc:
            return self._bad(exc, live=live)
        if not isinstance(record, TaskStateRecord):
            return self._bad(
                SchemaError(f"expected task_state, got {record.kind}", field="kind"), live=live
            )
        self.table.apply(record)
        return None

    def _fold_event(self, value: bytes | None, *, ref: object) -> str | None:
        if value is None:
            return None
        try:
            record = decode(value)
        except SchemaError as exc:
            return self._bad(exc, live=True)
        if not isinstance(record, TriggerEventRecord):
            return self._bad(
                SchemaError(f"expected trigger_event, got {record.kind}", field="kind"), live=True
            )
        self.table.apply(record, ref=ref)
        return None

    def _bad(self, exc: SchemaError, *, live: bool) -> str | None:
        self.bad_records += 1
        logger.warning("unreadable record skipped: %s", exc, extra={"field": exc.field})
        # Tasks records read during recovery were dead-lettered when first read live.
        return f"{type(exc).__name__}: {exc}" if live else None

    def _dead(self, message: Any, error: str) -> DeadLetter:
        return DeadLetter(
            topic=message.topic,
            partition=message.partition,
            offset=message.offset,
            key=message.key,
            value=message.value,
            error=error,
            error_type="SchemaError",
            member=self.group_id,
        )

    async def _publish(self, out: Sequence[Emit], dead: Sequence[DeadLetter] = ()) -> None:
        """Send ``out`` in waves, each acknowledged before the next: CancelRequests (the
        "removed" record that follows one is the proof it was sent), task states, then
        RunTasks (a worker's "running" must land after "queued")."""
        if not out and not dead:
            return
        producer = self._producer
        if producer is None:
            raise SchedulerError("the scheduler is not started")
        cancels: list[tuple[str, bytes | None, bytes]] = []
        states: list[tuple[str, bytes | None, bytes]] = []
        runs: list[tuple[str, bytes | None, bytes]] = []
        for emit in out:
            record = emit.record
            if isinstance(record, TaskStateRecord):
                states.append((self.names.tasks, record.task.ti_key.encode(), encode(record)))
            elif isinstance(record, RunTask):
                await self._ensure_worker_queue(record.worker_queue)
                topic = (
                    self.names.resumes(record.worker_queue)
                    if record.mode == "resume"
                    else self.names.work(record.worker_queue)
                )
                runs.append((topic, record.task.ti_key.encode(), encode(record)))
            elif isinstance(record, CancelRequest):
                topic = self.names.defer(emit.queue)
                cancels.append((topic, record.trigger_id.encode(), encode(record)))
        for letter in dead:
            states.append((self.names.dead, None, encode(letter)))
        waves = (cancels, states, runs)
        try:
            for wave in waves:
                futures = [
                    await producer.send(topic, value=value, key=key) for topic, key, value in wave
                ]
                if futures:
                    await asyncio.gather(*futures)
        except KafkaError as exc:
            raise SchedulerError(f"cannot publish scheduler decisions: {exc}") from exc
        self.published += sum(len(wave) for wave in waves)

    async def _ensure_worker_queue(self, worker_queue: str) -> None:
        if worker_queue in self._ensured_worker_queues:
            return
        await ensure_topics(self.settings, topic_specs(self.settings, worker_queues=[worker_queue]))
        self._ensured_worker_queues.add(worker_queue)

    def _committable(self) -> dict[TopicPartition, int]:
        """Per resume partition: the offset after the last published event, but never past
        an event still held pending (so a restart reads it again)."""
        offsets = dict(self._events_done)
        for ref in self.table.pending_refs():
            if isinstance(ref, tuple):
                tp, offset = ref
                if tp in offsets and offset < offsets[tp]:
                    offsets[tp] = offset
        return {
            tp: offset for tp, offset in offsets.items() if offset > self._committed.get(tp, -1)
        }

    async def _commit(self, events: AIOKafkaConsumer) -> None:
        offsets = {tp: o for tp, o in self._committable().items() if tp in events.assignment()}
        if not offsets:
            return
        await events.commit(offsets)
        self._committed.update(offsets)


class _SchedulerCollector(Collector):
    """Scheduler figures, read from the table at scrape time."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        table = self.scheduler.table
        c = table.counters
        events = CounterMetricFamily(
            "deferline_scheduler_events",
            "Trigger events read, by what the scheduler did with them.",
            labels=["verdict"],
        )
        for verdict, value in (
            ("applied", c.events_applied),
            ("duplicate", c.events_duplicate),
            ("direct", c.events_direct),
            ("cancelled", c.events_cancelled),
            ("orphaned", c.events_orphaned),
        ):
            events.add_metric([verdict], value)
        yield events
        yield _counter(
            "deferline_scheduler_duplicates_dropped",
            "Duplicate or stale events dropped.",
            c.events_duplicate,
        )
        enqueued = CounterMetricFamily(
            "deferline_scheduler_runs_enqueued", "RunTasks sent to workers.", labels=["mode"]
        )
        enqueued.add_metric(["start"], c.starts)
        enqueued.add_metric(["resume"], c.resumes)
        yield enqueued
        yield _counter(
            "deferline_scheduler_ended_by_trigger",
            "Tasks ended by their trigger.",
            c.ended_by_trigger,
        )
        yield _counter("deferline_scheduler_retries", "Retries scheduled.", c.retries)
        yield _counter("deferline_scheduler_cancels", "CancelRequests sent.", c.cancels)
        yield _counter(
            "deferline_scheduler_stale_states",
            "Task records behind the current state.",
            c.states_stale,
        )
        yield _counter(
            "deferline_scheduler_repairs",
            "Task states re-published over a stale record.",
            c.repairs,
        )
        yield _counter(
            "deferline_scheduler_bad_records",
            "Unreadable records skipped.",
            self.scheduler.bad_records,
        )
        used = GaugeMetricFamily(
            "deferline_scheduler_pool_slots_used", "Pool slots held.", labels=["pool"]
        )
        size = GaugeMetricFamily(
            "deferline_scheduler_pool_slots", "Pool size (absent: unlimited).", labels=["pool"]
        )
        for pool, (in_use, total) in table.pool_usage().items():
            used.add_metric([pool], in_use)
            if total is not None:
                size.add_metric([pool], total)
        yield used
        yield size
        states = GaugeMetricFamily(
            "deferline_scheduler_tasks", "Task instances by state.", labels=["state"]
        )
        for state, count in sorted(table.count_by_state().items()):
            states.add_metric([state], count)
        yield states
        yield GaugeMetricFamily(
            "deferline_scheduler_pending_events",
            "Events held until their deferral is read.",
            value=table.pending_events,
        )
        lag = GaugeMetricFamily(
            "deferline_scheduler_lag", "Records not yet read, per input.", labels=["input"]
        )
        for name, value in sorted(self.scheduler.lag.items()):
            lag.add_metric([name], value)
        yield lag


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


# -- command line ----------------------------------------------------------------------------


def _parse_pools(values: Iterable[str]) -> dict[str, int]:
    pools: dict[str, int] = {}
    for value in values:
        name, sep, slots = value.partition("=")
        if not sep or not name or not slots.isdigit():
            raise click.BadParameter(f"expected NAME=SLOTS, got {value!r}", param_hint="--pool")
        pools[name] = int(slots)
    return pools


@click.command("scheduler")
@connection_options
@layout_options
@click.option(
    "--pool",
    "pools",
    multiple=True,
    metavar="NAME=SLOTS",
    help="Slots of a pool (repeatable).",
)
@click.option(
    "--default-pool-slots",
    default="128",
    show_default=True,
    help="Slots of every pool not named by --pool (default_pool too); 'unlimited' for none.",
)
@click.option(
    "--worker-queue",
    "worker_queues",
    multiple=True,
    help="Worker queue whose topics are created at start (repeatable).",
)
@click.option("--group-id", default=None, help="Consumer group [<prefix>scheduler].")
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    default=None,
    help="Serve Prometheus metrics on this port (0: any free port).",
)
@click.option("--metrics-host", default="0.0.0.0", show_default=True)
@click.option(
    "--orphan-check-interval",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds between checks for events whose deferral never appears.",
)
@logging_options
def scheduler_command(
    settings: Settings,
    pools: tuple[str, ...],
    default_pool_slots: str,
    worker_queues: tuple[str, ...],
    group_id: str | None,
    metrics_port: int | None,
    metrics_host: str,
    orphan_check_interval: float,
) -> None:
    """Run the scheduler: fold trigger events into task state and resume tasks."""
    if default_pool_slots == "unlimited":
        default: int | None = None
    elif default_pool_slots.isdigit():
        default = int(default_pool_slots)
    else:
        raise click.BadParameter("a number or 'unlimited'", param_hint="--default-pool-slots")
    scheduler = Scheduler(
        settings,
        pools=Pools(slots=_parse_pools(pools), default_slots=default),
        worker_queues=worker_queues,
        group_id=group_id,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        orphan_check_interval=orphan_check_interval,
    )
    try:
        asyncio.run(_serve(scheduler))
    except DeferlineError as exc:
        raise click.ClickException(f"scheduler failed: {exc}") from exc


async def _serve(scheduler: Scheduler) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with scheduler:
        runner = asyncio.ensure_future(scheduler.wait())
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if runner in done:
            runner.result()
        else:
            runner.cancel()
    logger.info("scheduler stopped")
