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
import dataclasses
import logging
import signal
from collections.abc import Awaitable, Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Protocol

import click
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition
from deferline.engine import (
    Deferred,
    Failed,
    OperatorError,
    OperatorLoadError,
    OperatorResult,
    Skipped,
    Succeeded,
    deferral_records,
    load_operator,
    make_context,
    run_operator,
)
from deferline.schemas import (
    DeadLetter,
    DeferlineError,
    DeferRequest,
    KwargsCipher,
    ResumeTarget,
    RunTask,
    SchemaError,
    TaskStateRecord,
    decode_as,
    encode,
    make_trigger_id,
    seal,
)
from deferline.topics import (
    InvalidQueueName,
    Settings,
    TopicNames,
    ensure_topics,
    make_consumer,
    make_producer,
    topic_specs,
    validate_queue_name,
)
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._metrics import MetricsServer
from .._options import connection_options, logging_options
from ._state import AttemptProgress, OffsetTracker, SlotPool, WorkerMetrics

__all__ = ["RecordSink", "TaskRunner", "Worker", "WorkerError", "worker_command"]

logger = logging.getLogger(__name__)

_CATCH_UP_TIMEOUT = 60.0


class WorkerError(DeferlineError):
    """The worker could not read its queues or publish an outcome."""


class RecordSink(Protocol):
    """Where the worker writes records: ``send`` enqueues and returns the acknowledgement."""

    async def send(self, topic: str, key: bytes | None, value: bytes | None) -> Awaitable[Any]:
        """Enqueue one record; await the returned awaitable for the broker's ack."""
        ...


class _ProducerSink:
    """:class:`RecordSink` over an aiokafka producer; Kafka errors become WorkerError."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self._producer = producer

    async def send(self, topic: str, key: bytes | None, value: bytes | None) -> Awaitable[Any]:
        try:
            future = await self._producer.send(topic, value=value, key=key)
        except KafkaError as exc:
            raise WorkerError(f"cannot publish to {topic}: {exc}") from exc
        # A task, not a bare coroutine: the ack completes even if nobody awaits it (a run
        # abandoned at shutdown), without leaking an unawaited coroutine.
        return asyncio.ensure_future(self._acked(topic, future))

    @staticmethod
    async def _acked(topic: str, future: Awaitable[Any]) -> Any:
        try:
            return await future
        except KafkaError as exc:
            raise WorkerError(f"publishing to {topic} was not acknowledged: {exc}") from exc


@dataclasses.dataclass(slots=True)
class _KeyLock:
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    users: int = 0


class TaskRunner:
    """Runs one RunTask end to end: dedup, "running", operator code, outcome records.

    Operator code runs in ``executor`` (operators are synchronous, as in Airflow); everything
    else runs on the event loop. Outcomes are written in protocol order: "deferred" state,
    then the DeferRequest, each acknowledged before the next.

    Args:
        settings: topic prefix, allowed operator prefixes and kwargs keys.
        sink: where records go.
        progress: the dedup fold of the tasks topic (shared with the tasks-topic reader).
        executor: runs operator code; its size is the worker's slot count.
        metrics: counters to update.
        member: this worker's name in log lines.
        ensure_trigger_queue: called once per non-default trigger queue before its first
            DeferRequest (the worker creates the queue's topics); None skips it.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        sink: RecordSink,
        progress: AttemptProgress,
        executor: concurrent.futures.Executor,
        metrics: WorkerMetrics | None = None,
        member: str | None = None,
        ensure_trigger_queue: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._settings = settings
        self._ensure_trigger_queue = ensure_trigger_queue
        self._names = TopicNames(settings.topic_prefix)
        self._sink = sink
        self._progress = progress
        self._executor = executor
        self.metrics = metrics or WorkerMetrics()
        self.member = member
        self._cipher = KwargsCipher(settings.kwargs_keys) if settings.kwargs_keys else None
        self._allowed = tuple(settings.allowed_operator_prefixes)
        self._locks: dict[str, _KeyLock] = {}
        self._trigger_queues: set[str] = set()

    async def handle(self, run: RunTask) -> bool:
        """Run ``run`` unless the task has moved past it; returns False for a duplicate."""
        key = run.task.ti_key
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = _KeyLock()
        entry.users += 1
        try:
            async with entry.lock:  # one run per task instance at a time in this worker
                if self._progress.is_duplicate(run):
                    self.metrics.duplicates += 1
                    logger.info(
                        "duplicate RunTask ignored",
                        extra={
                            "task": str(run.task),
                            "mode": run.mode,
                            "trigger_id": run.trigger_id,
                            "defer_seq": run.defer_seq,
                            "member": self.member,
                        },
                    )
                    return False
                loop = asyncio.get_running_loop()
                started = loop.time()
                try:
                    await self._run(run)
                finally:
                    self.metrics.slot_seconds += loop.time() - started
                return True
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[key]

    async def _run(self, run: RunTask) -> None:
        resumed = run.mode == "resume"
        if resumed:
            self.metrics.resumed += 1
        else:
            self.metrics.started += 1
        target = ResumeTarget(
            operator=run.operator,
            op_kwargs=run.op_kwargs,
            worker_queue=run.worker_queue,
            pool=run.pool,
            pool_slots=run.pool_slots,
            priority_weight=run.priority_weight,
            retries=run.retries,
        )
        running = TaskStateRecord(
            task=run.task,
            state="running",
            trigger_id=(run.trigger_id or make_trigger_id(run.task, run.defer_seq))
            if resumed
            else None,
            defer_seq=run.defer_seq if resumed else 0,
            next_method=run.next_method if resumed else None,
            event_id=run.event_id,
            source="worker",
            resume=target,
        )
        self._progress.observe(running)
        running_ack = await self._publish_state(running)
        logger.debug(
            "task running",
            extra={"task": str(run.task), "mode": run.mode, "member": self.member},
        )
        loop = asyncio.get_running_loop()
        result, trigger_queue = await loop.run_in_executor(self._executor, self._execute, run)
        await running_ack
        await self._publish_outcome(run, target, result, trigger_queue)

    def _execute(self, run: RunTask) -> tuple[OperatorResult, str | None]:
        """Build a fresh operator and run one stretch of it (in the executor)."""
        try:
            operator = load_operator(
                run.operator,
                run.op_kwargs,
                task_id=run.task.task_id,
                allowed_prefixes=self._allowed,
            )
        except OperatorLoadError as exc:
            return Failed(str(exc), type(exc).__name__, None, retryable=False), None
        resumed = run.mode == "resume"
        context = make_context(
            operator,
            run.task,
            trigger_id=run.trigger_id if resumed else None,
            defer_seq=run.defer_seq if resumed else 0,
            event=run.event if resumed else None,
            event_id=run.event_id if resumed else None,
        )
        result = run_operator(
            operator,
            context,
            next_method=(run.next_method or "execute_complete") if resumed else None,
            next_kwargs=run.next_kwargs,
        )
        return result, operator.trigger_queue

    async def _publish_outcome(
        self,
        run: RunTask,
        target: ResumeTarget,
        result: OperatorResult,
        trigger_queue: str | None,
    ) -> None:
        extra = {"task": str(run.task), "member": self.member}
        if isinstance(result, Deferred):
            defer_seq = run.defer_seq + 1 if run.mode == "resume" else 0
            try:
                state, request = deferral_records(
                    run.task,
                    result.deferral,
                    defer_seq=defer_seq,
                    resume=target,
                    trigger_queue=trigger_queue,
                )
                # Encode now: kwargs that cannot go on the wire fail this task, not the worker.
                wire = (encode(state), encode(seal(request, self._cipher)))
            except (OperatorError, SchemaError, ValueError, TypeError) as exc:
                result = Failed(f"cannot defer: {exc}", type(exc).__name__, None)
            else:
                await self._publish_deferral(state, request, wire)
                self.metrics.deferred += 1
                logger.info(
                    "task deferred",
                    extra={**extra, "trigger_id": request.trigger_id, "defer_seq": defer_seq},
                )
                return
        if isinstance(result, Succeeded):
            record = _success_record(run, target, result.value)
            self.metrics.succeeded += 1
            if record.reason is not None:
                logger.warning("task succeeded; %s", record.reason, extra=extra)
            else:
                logger.info("task succeeded", extra=extra)
        elif isinstance(result, Skipped):
            record = TaskStateRecord(
                task=run.task, state="skipped", reason=result.reason, source="worker", resume=target
            )
            self.metrics.skipped += 1
            logger.info("task skipped", extra={**extra, "reason": result.reason})
        else:
            assert isinstance(result, Failed)
            retry = result.retryable and run.task.try_number <= run.retries
            record = TaskStateRecord(
                task=run.task,
                state="up_for_retry" if retry else "failed",
                reason=f"{result.error_type}: {result.error}",
                source="worker",
                resume=target,
            )
            if retry:
                self.metrics.retried += 1
            else:
                self.metrics.failed += 1
            logger.warning(
                "task %s: %s: %s%s",
                record.state,
                result.error_type,
                result.error,
                f"\n{result.traceback}" if result.traceback else "",
                extra=extra,
            )
        self._progress.observe(record)
        await (await self._publish_state(record))

    async def _publish_deferral(
        self, state: TaskStateRecord, request: DeferRequest, wire: tuple[bytes, bytes]
    ) -> None:
        """Protocol order: the "deferred" state is durable before the DeferRequest is sent."""
        queue = request.queue
        if queue is not None and queue not in self._trigger_queues:
            if self._ensure_trigger_queue is not None:
                await self._ensure_trigger_queue(queue)
            self._trigger_queues.add(queue)
        self._progress.observe(state)
        key = state.task.ti_key.encode()
        await (await self._sink.send(self._names.tasks, key, wire[0]))
        topic = self._names.defer(queue)
        await (await self._sink.send(topic, request.trigger_id.encode(), wire[1]))

    async def _publish_state(self, record: TaskStateRecord) -> Awaitable[Any]:
        return await self._sink.send(self._names.tasks, record.task.ti_key.encode(), encode(record))


def _success_record(run: RunTask, target: ResumeTarget, value: Any) -> TaskStateRecord:
    """The success state, carrying the return value as the ``return_value`` xcom when it encodes.

    A value the tagged codec cannot encode does not fail the task: the record carries no
    xcoms and its ``reason`` says why the value was not stored.
    """
    if value is None:
        return TaskStateRecord(task=run.task, state="success", source="worker", resume=target)
    record = TaskStateRecord(
        task=run.task,
        state="success",
        source="worker",
        resume=target,
        xcoms={"return_value": value},
    )
    try:
        encode(record)
    except (SchemaError, ValueError, TypeError) as exc:
        return TaskStateRecord(
            task=run.task,
            state="success",
            source="worker",
            resume=target,
            reason=f"return value not stored: {exc}",
        )
    return record


async def _ensure(
    settings: Settings, *, queues: Sequence[str] = (), worker_queues: Sequence[str] = ()
) -> None:
    await ensure_topics(settings, topic_specs(settings, queues=queues, worker_queues=worker_queues))


class _TasksTail:
    """Reads the tasks topic from the start into :class:`AttemptProgress`, and keeps up."""

    def __init__(self, settings: Settings, progress: AttemptProgress) -> None:
        self._topic = TopicNames(settings.topic_prefix).tasks
        self._progress = progress
        self._consumer = make_consumer(settings, self._topic, group_id=None)
        self._advanced = asyncio.Event()
        self.records = 0

    async def start(self) -> None:
        try:
            await self._consumer.start()
        except KafkaError as exc:
            raise WorkerError(f"cannot read {self._topic}: {exc}") from exc

    async def stop(self) -> None:
        await self._consumer.stop()

    async def run(self) -> None:
        """Fold records until cancelled."""
        consumer = self._consumer
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            except KafkaError as exc:
                raise WorkerError(f"reading {self._topic} failed: {exc}") from exc
            for records in batches.values():
                for record in records:
                    self._fold(record)
            self._advanced.set()

    def _fold(self, record: ConsumerRecord[bytes, bytes]) -> None:
        self.records += 1
        if record.value is None:
            if record.key is not None:
                self._progress.forget(record.key.decode(errors="replace"))
            return
        try:
            state = decode_as(record.value, TaskStateRecord)
        except SchemaError as exc:
            logger.warning(
                "unreadable record on the tasks topic skipped: %s",
                exc,
                extra={"partition": record.partition, "offset": record.offset},
            )
            return
        self._progress.observe(state)

    async def sync(self) -> None:
        """Return once everything on the tasks topic as of now has been folded."""
        consumer = self._consumer
        while not consumer.assignment():
            self._advanced.clear()
            await self._advanced.wait()
        tps = sorted(consumer.assignment())
        try:
            ends = await consumer.end_offsets(tps)
        except KafkaError as exc:
            raise WorkerError(f"cannot read end offsets of {self._topic}: {exc}") from exc
        while True:
            behind = False
            for tp in tps:
                if await consumer.position(tp) < ends[tp]:
                    behind = True
                    break
            if not behind:
                return
            self._advanced.clear()
            await self._advanced.wait()


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


class _WorkerCollector(Collector):
    """Worker figures read at scrape time."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        worker = self._worker
        counters = worker.metrics
        labels = ["queue"]
        value = [worker.queue]
        for name, help_text, figure in (
            ("deferline_worker_tasks_started", "RunTasks started.", counters.started),
            ("deferline_worker_tasks_resumed", "RunTasks resumed.", counters.resumed),
            ("deferline_worker_tasks_succeeded", "Tasks that succeeded.", counters.succeeded),
            ("deferline_worker_tasks_failed", "Tasks that failed.", counters.failed),
            ("deferline_worker_tasks_retried", "Tasks set up for retry.", counters.retried),
            ("deferline_worker_tasks_skipped", "Tasks skipped.", counters.skipped),
            ("deferline_worker_tasks_deferred", "Deferrals published.", counters.deferred),
            ("deferline_worker_duplicates", "Duplicate RunTasks ignored.", counters.duplicates),
            (
                "deferline_worker_slot_seconds",
                "Worker-slot seconds spent running operators.",
                counters.slot_seconds,
            ),
        ):
            family = CounterMetricFamily(name, help_text, labels=labels)
            family.add_metric(value, figure)
            yield family
        for name, help_text, figure in (
            ("deferline_worker_slots", "Configured worker slots.", worker.slots.size),
            ("deferline_worker_slots_busy", "Worker slots in use.", worker.slots.busy),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=labels)
            gauge.add_metric(value, figure)
            yield gauge


class Worker:
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
        heartbeat_interval_ms: int = 1_000,
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
        self._tail: _TasksTail | None = None
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
        self.registry.register(_WorkerCollector(self))
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
            await self._producer.start()
            self._tail = _TasksTail(self.settings, self.progress)
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
            await self._consumer.start()
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
            sink=_ProducerSink(self._producer),
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

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

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
            # Surface the first failure itself, not the TaskGroup's wrapper.
            raise group_error.exceptions[0] from None
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
        sink = _ProducerSink(self._producer)
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
        for client in (self._consumer, self._tail, self._producer):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.stop()
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


# --------------------------------------------------------------------------- command


@click.command("worker")
@click.option("--slots", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--queue", default="default", show_default=True, help="Worker queue to consume.")
@click.option(
    "--graceful-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds to let running operators finish on SIGTERM/SIGINT.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    default=None,
    help="Serve Prometheus metrics on this port (0: any free port).",
)
@click.option("--metrics-host", default="0.0.0.0", show_default=True)
@click.option(
    "--session-timeout-ms", type=click.IntRange(min=1000), default=10_000, show_default=True
)
@click.option(
    "--heartbeat-interval-ms", type=click.IntRange(min=100), default=1_000, show_default=True
)
@logging_options
@connection_options
def worker_command(
    settings: Settings,
    slots: int,
    queue: str,
    graceful_timeout: float,
    metrics_port: int | None,
    metrics_host: str,
    session_timeout_ms: int,
    heartbeat_interval_ms: int,
) -> None:
    """Run a worker that executes operators and defers them.

    Operators must live under DEFERLINE_ALLOWED_OPERATOR_PREFIXES
    (default: deferline.engine.examples).
    """
    try:
        worker = Worker(
            settings,
            slots=slots,
            queue=queue,
            graceful_timeout=graceful_timeout,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
        )
    except InvalidQueueName as exc:
        raise click.BadParameter(str(exc), param_hint="--queue") from exc
    try:
        asyncio.run(_serve(worker))
    except DeferlineError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"worker stopped: {worker.metrics.as_dict()}")


async def _serve(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with worker:
        waiter = asyncio.create_task(worker.wait())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if waiter.done():
            waiter.result()
        else:
            waiter.cancel()
