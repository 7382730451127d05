"""One RunTask end to end: dedup, "running", operator code, outcome records, in protocol order.

:class:`TaskRunner` writes through a :class:`RecordSink` (over an aiokafka producer in the
worker, an in-memory fake in unit tests), so the decisions are testable without a broker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
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
    DeferRequest,
    KwargsCipher,
    ResumeTarget,
    RunTask,
    SchemaError,
    TaskStateRecord,
    encode,
    make_trigger_id,
    seal,
)
from deferline.topics import Settings, TopicNames, trace_send

from ._errors import WorkerError
from ._state import AttemptProgress, WorkerMetrics

__all__ = ["ProducerSink", "RecordSink", "TaskRunner"]

logger = logging.getLogger(__name__)


class RecordSink(Protocol):
    """Where the worker writes records: ``send`` enqueues and returns the acknowledgement."""

    async def send(self, topic: str, key: bytes | None, value: bytes | None) -> Awaitable[Any]:
        """Enqueue one record; await the returned awaitable for the broker's ack."""
        ...


class ProducerSink:
    """:class:`RecordSink` over an aiokafka producer; Kafka errors become WorkerError."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self._producer = producer

    async def send(self, topic: str, key: bytes | None, value: bytes | None) -> Awaitable[Any]:
        try:
            headers = trace_send(topic, value)
            future = await self._producer.send(topic, value=value, key=key, headers=headers)
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
