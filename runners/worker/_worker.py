"""The worker: runs operators from the worker queue topics and publishes what they did.

A worker is a member of the consumer group of one worker queue. It reads the queue's resume
topic ahead of its start topic (a backlog of resumes pauses new work) and takes only as many
RunTasks as it has free slots, so waiting work stays in Kafka where a resume can overtake
it. A slot is held only while operator code runs and its outcome is published: a task that
defers writes its "deferred" state, then its DeferRequest, and frees the slot once both are
acknowledged. Offsets are committed only after a RunTask's outcome is durable.

Dedup: every state change of a task lands on the compacted tasks topic; the worker folds it
(:class:`AttemptProgress`) and ignores a RunTask the task has already moved past. The worker
reads the tasks topic to its end before it takes work, and again after every partition
assignment (a RunTask redelivered after a rebalance is checked against what its previous
owner published), so the rule holds across restarts and across workers. Duplicates of one
RunTask that arrive together (direct resume plus the scheduler's) land on the same partition
and are serialised per task instance, so the second sees the first's outcome.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Sequence

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition
from deferline.schemas import DeadLetter, RunTask, SchemaError, decode_as, encode
from deferline.topics import (
    Lifecycle,
    Settings,
    TopicNames,
    ensure_topics,
    make_consumer,
    make_producer,
    start_client,
    stop_client,
    topic_specs,
    trace_receive,
    validate_queue_name,
)
from prometheus_client import CollectorRegistry

from .._metrics import MetricsServer
from ._errors import WorkerError
from ._metrics import WorkerCollector
from ._runner import ProducerSink, TaskRunner
from ._state import AttemptProgress, OffsetTracker, SlotPool, WorkerMetrics
from ._tasks_tail import TasksTail

__all__ = ["Worker"]

logger = logging.getLogger(__name__)

_CATCH_UP_TIMEOUT = 60.0


async def _ensure(
    settings: Settings, *, queues: Sequence[str] = (), worker_queues: Sequence[str] = ()
) -> None:
    await ensure_topics(settings, topic_specs(settings, queues=queues, worker_queues=worker_queues))


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._worker._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._worker._joined()
        logger.info(
            "worker partitions assigned",
            extra={
                "partitions": sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned),
                "member": self._worker.member,
            },
        )


class Worker(Lifecycle):
    """Runs operators from one worker queue with ``slots`` concurrent slots.

    Use ``async with Worker(settings) as worker: await worker.wait()`` or ``start()`` /
    ``stop()``. ``stop()`` stops taking work, waits up to ``graceful_timeout`` seconds for
    running operators to finish and publish, commits, and closes; a run still going after that
    is abandoned uncommitted, so its RunTask is delivered again (and re-run) later.

    Args:
        settings: connection, topic prefix, allowed operator prefixes, kwargs keys.
        slots: operators that may run at once.
        queue: the worker queue to consume (``queue`` / ``queue.<name>`` topics).
        group_id: consumer group; default ``<prefix>worker.<queue>``.
        graceful_timeout: seconds ``stop()`` waits for running operators.
        ensure: create missing topics at start.
        poll_interval: seconds one fetch waits for new RunTasks.
        metrics_port: serve Prometheus metrics on this port (0: any free port; None: off).
        metrics_host: interface the metrics endpoint binds.
        session_timeout_ms / heartbeat_interval_ms: consumer-group liveness; a worker that
            stops heartbeating loses its partitions (and their uncommitted RunTasks) after
            the session timeout.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        slots: int = 4,
        queue: str = "default",
        group_id: str | None = None,
        graceful_timeout: float = 30.0,
        ensure: bool = True,
        poll_interval: float = 0.1,
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 250,
    ) -> None:
        self.settings = settings
        self._group_timing = {
            "session_timeout_ms": session_timeout_ms,
            "heartbeat_interval_ms": heartbeat_interval_ms,
        }
        self.queue = validate_queue_name(queue, worker=True)
        names = TopicNames(settings.topic_prefix)
        self._work_topic = names.work(self.queue)
        self._resumes_topic = names.resumes(self.queue)
        self._dead_topic = names.dead
        self.group_id = group_id or f"{settings.topic_prefix}worker.{self.queue}"
        self._graceful_timeout = graceful_timeout
        self._ensure = ensure
        self._poll_ms = max(1, int(poll_interval * 1000))
        self.slots = SlotPool(slots)
        self.metrics = WorkerMetrics()
        self.progress = AttemptProgress()
        self._offsets = OffsetTracker()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._tail: TasksTail | None = None
        self._runner: TaskRunner | None = None
        self._main: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._ready = asyncio.Event()
        self._handlers: set[asyncio.Task[None]] = set()
        self._paused: set[TopicPartition] = set()
        self._assigned_since_sync = False
        self._stash: list[tuple[TopicPartition, ConsumerRecord[bytes, bytes]]] = []
        self.member: str | None = None
        self.registry = CollectorRegistry()
        self.registry.register(WorkerCollector(self.queue, self.slots, self.metrics))
        self._server = (
            MetricsServer(self.registry, host=metrics_host, port=metrics_port)
            if metrics_port is not None
            else None
        )

    @property
    def metrics_port(self) -> int | None:
        """The port metrics are served on, once started (None when off)."""
        return self._server.port if self._server is not None else None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, catch up with the tasks topic, join the group and start taking work."""
        if self._main is not None:
            return
        self._stopping.clear()
        self._ready.clear()
        if self._ensure:
            await _ensure(self.settings, worker_queues=[self.queue])
        try:
            self._producer = make_producer(self.settings)
            await start_client(self._producer, grace=5.0, name="worker producer")
            self._tail = TasksTail(self.settings, self.progress)
            await self._tail.start()
            self._consumer = make_consumer(
                self.settings,
                group_id=self.group_id,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                **self._group_timing,
            )
            self._consumer.subscribe(
                [self._resumes_topic, self._work_topic], listener=_Rebalance(self)
            )
            await start_client(self._consumer, grace=5.0, name="worker consumer")
        except KafkaError as exc:
            await self._close_clients()
            raise WorkerError(
                f"cannot connect to {self.settings.bootstrap_servers}: {exc}"
            ) from exc
        except BaseException:
            await self._close_clients()
            raise
        if self._server is not None:
            try:
                await self._server.start()
            except BaseException:
                await self._close_clients()
                raise
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.slots.size, thread_name_prefix="deferline-worker"
        )
        self._runner = TaskRunner(
            self.settings,
            sink=ProducerSink(self._producer),
            progress=self.progress,
            executor=self._executor,
            metrics=self.metrics,
            member=self.member,
            ensure_trigger_queue=self._ensure_trigger_queue if self._ensure else None,
        )
        self._main = asyncio.create_task(self._supervise(), name=f"worker-{self.queue}")
        logger.info(
            "worker started",
            extra={"queue": self.queue, "slots": self.slots.size, "group": self.group_id},
        )

    async def stop(self) -> None:
        """Stop taking work, let running operators finish (bounded), commit and close."""
        self._stopping.set()
        main, self._main = self._main, None
        if main is None:
            return
        try:
            await main
        finally:
            if self._executor is not None:
                # Threads still running an abandoned operator finish on their own.
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
            logger.info(
                "worker stopped",
                extra={"queue": self.queue, "member": self.member, **self.metrics.as_dict()},
            )

    async def wait_ready(self) -> None:
        """Wait until the worker has read the tasks topic and joined its group."""
        main = self._main
        if main is None:
            raise WorkerError("the worker is not started")
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait({ready, main}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if not self._ready.is_set():
            await main  # raises the error that stopped it
            raise WorkerError("the worker stopped before it was ready")

    async def wait(self) -> None:
        """Wait until the worker stops (after ``stop()`` or a fatal error, which is raised)."""
        main = self._main
        if main is not None:
            await asyncio.shield(main)

    # -- the loop ----------------------------------------------------------------------------

    async def _supervise(self) -> None:
        assert self._tail is not None
        try:
            async with asyncio.TaskGroup() as group:
                tail = group.create_task(self._tail.run(), name="worker-tasks-tail")
                try:
                    async with asyncio.timeout(_CATCH_UP_TIMEOUT):
                        await self._tail.sync()
                except TimeoutError as exc:
                    raise WorkerError(
                        f"could not read {TopicNames(self.settings.topic_prefix).tasks} to its "
                        f"end within {_CATCH_UP_TIMEOUT:g}s (does the topic exist?)"
                    ) from exc
                try:
                    await self._consume(group)
                finally:
                    await self._drain()
                    await self._commit()
                    tail.cancel()
        except BaseExceptionGroup as group_error:
            # Surface the first failure itself, not the TaskGroup's wrapper, with its cause
            # (a lost cluster is told by it).
            first = group_error.exceptions[0]
            raise first from first.__cause__
        finally:
            await self._close_clients()

    async def _consume(self, group: asyncio.TaskGroup) -> None:
        consumer = self._consumer
        tail = self._tail
        assert consumer is not None
        assert tail is not None
        while not self._stopping.is_set():
            if self.slots.free == 0:
                await self._wait_while_full()
                await self._commit()
                continue
            await self._prioritise()
            free = self.slots.free
            batch = self._stash[:free]
            del self._stash[:free]
            if len(batch) < free:
                batch += await self._fetch(free - len(batch))
            if batch and self._assigned_since_sync:
                self._assigned_since_sync = False
                await tail.sync()
            for tp, record in batch:
                self.slots.take()
                self._offsets.started(tp, record.offset)
                task = group.create_task(self._handle(tp, record))
                self._handlers.add(task)
                task.add_done_callback(self._handlers.discard)
            await self._commit()

    async def _wait_while_full(self) -> None:
        """All slots busy: new work waits, resumes are set aside to go first.

        Nothing is paused (records already fetched stay in the consumer's buffer), but only
        the resume partitions are polled: up to one slot-count of resumes is taken into a
        local stash that the next free slot drains before anything else. Polling keeps this
        member alive in the group however long the operators run. Stashed records are not
        committed until handled, so a rebalance or shutdown simply redelivers them.
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._poll_ms / 1000):
                await self.slots.wait_free()
        consumer = self._consumer
        assert consumer is not None
        assignment = consumer.assignment()
        resume_tps = [tp for tp in assignment if tp.topic == self._resumes_topic]
        room = self.slots.size - len(self._stash)
        if resume_tps and room > 0:
            self._set_paused(self._paused - set(resume_tps))
            data = await self._getmany(*resume_tps, timeout_ms=0, max_records=room)
            self._stash += sorted(
                ((tp, r) for tp, records in data.items() for r in records),
                key=lambda item: item[1].offset,
            )
        else:
            # Nothing to stash into: poll paused partitions, which returns nothing.
            poll = resume_tps or sorted(assignment)
            if poll:
                self._set_paused(self._paused | set(poll))
                await self._getmany(*poll, timeout_ms=0)

    async def backlog(self) -> dict[str, int]:
        """Records waiting on this worker's assigned partitions, per topic (as last fetched)."""
        consumer = self._consumer
        out = {self._resumes_topic: 0, self._work_topic: 0}
        if consumer is None:
            return out
        for tp in consumer.assignment():
            high = consumer.highwater(tp)
            if high is not None:
                out[tp.topic] = out.get(tp.topic, 0) + max(0, high - await consumer.position(tp))
        return out

    async def _getmany(
        self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        assert self._consumer is not None
        try:
            result: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
            result = await self._consumer.getmany(
                *partitions, timeout_ms=timeout_ms, max_records=max_records
            )
        except KafkaError as exc:
            raise WorkerError(f"consuming the worker queue failed: {exc}") from exc
        return result

    async def _fetch(self, limit: int) -> list[tuple[TopicPartition, ConsumerRecord[bytes, bytes]]]:
        """Up to ``limit`` RunTasks, resumes first."""
        assert self._consumer is not None
        resume_tps = [tp for tp in self._consumer.assignment() if tp.topic == self._resumes_topic]
        data: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {}
        if resume_tps:
            data = await self._getmany(*resume_tps, timeout_ms=0, max_records=limit)
        if not data:
            data = await self._getmany(timeout_ms=self._poll_ms, max_records=limit)
        out = [(tp, record) for tp, records in data.items() for record in records]
        out.sort(key=lambda item: (item[0].topic != self._resumes_topic, item[1].offset))
        return out

    async def _prioritise(self) -> None:
        """Pause the start topic while the resume topic has a backlog; else fetch both."""
        consumer = self._consumer
        assert consumer is not None
        assignment = consumer.assignment()
        if (await self.backlog())[self._resumes_topic]:
            self._set_paused({tp for tp in assignment if tp.topic == self._work_topic})
        else:
            self._set_paused(set())

    def _set_paused(self, wanted: set[TopicPartition]) -> None:
        consumer = self._consumer
        assert consumer is not None
        assigned = consumer.assignment()
        wanted &= assigned
        current = self._paused & assigned
        if wanted - current:
            consumer.pause(*(wanted - current))
        if current - wanted:
            consumer.resume(*(current - wanted))
        self._paused = wanted

    async def _handle(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> None:
        assert self._runner is not None
        trace_receive(tp.topic, record.value, record.headers)
        try:
            try:
                run = decode_as(record.value or b"", RunTask)
            except SchemaError as exc:
                await self._dead_letter(tp, record, exc)
            else:
                await self._runner.handle(run)
            self._offsets.finished(tp, record.offset)
        finally:
            self.slots.give_back()

    async def _dead_letter(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], exc: Exception
    ) -> None:
        logger.error(
            "unreadable RunTask dead-lettered: %s",
            exc,
            extra={"partition": tp.partition, "offset": record.offset, "member": self.member},
        )
        letter = DeadLetter(
            topic=tp.topic,
            partition=tp.partition,
            offset=record.offset,
            key=record.key,
            value=record.value,
            error=str(exc),
            error_type=type(exc).__name__,
            member=self.member,
        )
        assert self._producer is not None
        sink = ProducerSink(self._producer)
        await (await sink.send(self._dead_topic, record.key, encode(letter)))

    async def _commit(self) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        offsets = {
            tp: offset
            for tp, offset in self._offsets.committable().items()
            if isinstance(tp, TopicPartition) and tp in consumer.assignment()
        }
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except KafkaError as exc:
            # A rebalance in progress; the records are delivered again and dedup drops them.
            logger.warning("offset commit failed: %s", exc, extra={"member": self.member})
            return
        self._offsets.committed(dict(offsets))

    async def _drain(self) -> None:
        """Wait (bounded) for running handlers; abandon the rest uncommitted."""
        if not self._handlers:
            return
        _done, pending = await asyncio.wait(set(self._handlers), timeout=self._graceful_timeout)
        for task in pending:
            task.cancel()
        if pending:
            logger.warning(
                "%d running task(s) abandoned at shutdown; they will be delivered again",
                len(pending),
                extra={"member": self.member},
            )
            await asyncio.wait(pending)

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Let runs from revoked partitions finish (bounded) and commit them before handover."""
        self._stash = [(tp, record) for tp, record in self._stash if tp not in revoked]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._graceful_timeout
        while any(self._offsets.in_flight(tp) for tp in revoked) and loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await self.slots.wait_free()
            await asyncio.sleep(0)
        await self._commit()
        self._offsets.drop(revoked)
        self._paused -= revoked

    async def _close_clients(self) -> None:
        if self._server is not None:
            await self._server.stop()
        # stop_client always closes the connections (aiokafka's stop() can end half way).
        if self._consumer is not None:
            await stop_client(self._consumer, grace=10.0, name="worker consumer")
        if self._tail is not None:
            await self._tail.stop()
        if self._producer is not None:
            await stop_client(self._producer, grace=10.0, name="worker producer")
        self._consumer = None
        self._tail = None
        self._producer = None

    async def _ensure_trigger_queue(self, queue: str) -> None:
        await _ensure(self.settings, queues=[queue])

    def _joined(self) -> None:
        """After an assignment: re-read the tasks topic before the next batch; learn our id."""
        self._assigned_since_sync = True
        self._ready.set()
        coordinator = getattr(self._consumer, "_coordinator", None)
        member = getattr(coordinator, "member_id", None)
        self.member = str(member) if member else self.settings.client_id
        if self._runner is not None:
            self._runner.member = self.member
