"""Client API: submit tasks, defer from any orchestrator, cancel, clear and read task state.

Every call is a message on a topic (or a read of one): ``submit`` writes a "scheduled" task
state for the scheduler to admit, ``defer`` publishes a DeferRequest as a worker would,
``cancel`` a CancelRequest, ``clear`` a "removed" task state (the scheduler then cancels the
task's trigger). Reads fold the compacted tasks topic to its end: latest record per task.
"""

from __future__ import annotations

import datetime as dt
import importlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition
from deferline.engine import (
    BaseOperator,
    BaseTrigger,
    OperatorKwargsError,
    SerializedTrigger,
    TaskDeferred,
    deferral_records,
    prepare_airflow_import,
    start_deferral,
)
from deferline.schemas import (
    CancelRequest,
    DeferlineError,
    DeferRequest,
    KwargsCipher,
    ResumeTarget,
    SchemaError,
    TaskKey,
    TaskState,
    TaskStateRecord,
    decode,
    encode,
    seal,
)
from deferline.topics import (
    Lifecycle,
    Settings,
    TopicNames,
    describe_topics,
    ensure_topics,
    make_consumer,
    make_producer,
    partition_for,
    start_client,
    stop_client,
    topic_specs,
)

__all__ = ["Client", "ClientError", "TaskNotFound", "parse_ti_key"]

logger = logging.getLogger(__name__)


class ClientError(DeferlineError):
    """A client request could not be carried out."""


class TaskNotFound(ClientError):
    """No task instance (or active trigger) with that key is on the topics."""


def parse_ti_key(text: str) -> str:
    """Normalise ``dag/task/run[/map_index]`` to a task-instance key (map index -1 if absent).

    The run id may itself contain ``/``; give the map index explicitly in that case.
    """
    parts = text.split("/")
    if len(parts) < 3 or not all(parts[:2]) or not parts[2]:
        raise ClientError(f"{text!r} is not a task key: expected dag_id/task_id/run_id[/map_index]")
    last = parts[-1]
    if len(parts) >= 4 and (last.isdigit() or last == "-1"):
        return text
    return f"{text}/-1"


def _ti_key(task: TaskKey | str) -> str:
    return task.ti_key if isinstance(task, TaskKey) else parse_ti_key(task)


def _classpath(operator: str | type[BaseOperator]) -> str:
    if isinstance(operator, str):
        return operator
    return f"{operator.__module__}.{operator.__qualname__}"


class Client(Lifecycle):
    """Talks to deferline through its topics. Use ``async with Client(settings) as client``.

    Args:
        settings: connection, topic prefix and kwargs keys (DeferRequests are sealed when
            ``kwargs_keys`` is set).
        ensure: create missing topics before the first write to them.
    """

    def __init__(self, settings: Settings | None = None, *, ensure: bool = True) -> None:
        self.settings = settings or Settings()
        self.names = TopicNames(self.settings.topic_prefix)
        self._ensure = ensure
        self._ensured: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()
        self._cipher = (
            KwargsCipher(self.settings.kwargs_keys) if self.settings.kwargs_keys else None
        )
        self._producer: AIOKafkaProducer | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect the producer (reads open their own short-lived consumers)."""
        if self._producer is not None:
            return
        producer = make_producer(self.settings)
        try:
            await start_client(producer, grace=5.0, name="client producer")
        except BaseException as exc:  # a start that fails or is cancelled holds connections
            await stop_client(producer, grace=5.0, name="client producer")
            if not isinstance(exc, KafkaError):
                raise
            raise ClientError(
                f"cannot reach Kafka at {self.settings.bootstrap_servers}: {exc}"
            ) from exc
        self._producer = producer

    async def stop(self) -> None:
        """Flush and disconnect (idempotent)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            await stop_client(producer, grace=10.0, name="client producer")

    # -- writing -----------------------------------------------------------------------------

    async def submit(
        self,
        operator: str | type[BaseOperator],
        *,
        dag_id: str,
        task_id: str,
        run_id: str,
        op_kwargs: Mapping[str, Any] | None = None,
        map_index: int = -1,
        try_number: int = 1,
        pool: str = "default_pool",
        pool_slots: int = 1,
        priority_weight: int = 1,
        retries: int = 0,
        queue: str = "default",
        start_from_trigger: bool | None = None,
    ) -> TaskKey:
        """Submit a task; the scheduler starts it on a worker of ``queue`` when ``pool`` has room.

        An operator with ``start_from_trigger`` (detected when its class is importable here;
        ``start_from_trigger=False`` skips the check) is not scheduled: its deferred state and
        DeferRequest are published directly, so it takes no worker slot until it resumes.
        """
        kwargs = dict(op_kwargs or {})
        try:
            task = TaskKey(
                dag_id=dag_id,
                task_id=task_id,
                run_id=run_id,
                map_index=map_index,
                try_number=try_number,
            )
            target = ResumeTarget(
                operator=_classpath(operator),
                op_kwargs=kwargs,
                worker_queue=queue,
                pool=pool,
                pool_slots=pool_slots,
                priority_weight=priority_weight,
                retries=retries,
            )
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise ClientError(f"invalid task: {exc}") from exc
        deferral, trigger_queue = self._start_deferral(operator, task, kwargs, start_from_trigger)
        if deferral is not None:
            state, request = deferral_records(
                task,
                deferral,
                defer_seq=0,
                resume=target,
                trigger_queue=trigger_queue,
                source="client",
            )
            await self._publish_deferral(state, request, worker_queue=queue)
            logger.info(
                "task submitted to start from its trigger",
                extra={"task": str(task), "trigger_id": request.trigger_id},
            )
            return task
        record = TaskStateRecord(task=task, state="scheduled", source="client", resume=target)
        await self._ensure_topics(worker_queues=(queue,))
        await self._send(self.names.tasks, task.ti_key.encode(), encode(record))
        logger.info("task submitted", extra={"task": str(task), "queue": queue})
        return task

    def _start_deferral(
        self,
        operator: str | type[BaseOperator],
        task: TaskKey,
        op_kwargs: dict[str, Any],
        wanted: bool | None,
    ) -> tuple[TaskDeferred | None, str | None]:
        if wanted is False:
            return None, None
        cls = operator if isinstance(operator, type) else _import_quietly(operator)
        if cls is None or not (wanted or cls.start_from_trigger):
            if wanted:
                raise ClientError(f"cannot import {operator!r} to start it from its trigger")
            return None, None
        try:
            instance = cls(task_id=task.task_id, **op_kwargs)
        except TypeError as exc:
            raise OperatorKwargsError(
                f"{_classpath(operator)} rejected its kwargs: {exc}", classpath=_classpath(operator)
            ) from exc
        deferral = start_deferral(instance)
        if deferral is None and wanted:
            raise ClientError(f"{_classpath(operator)} has no start_trigger_args")
        return deferral, instance.trigger_queue

    async def defer(
        self,
        task: TaskKey,
        trigger: BaseTrigger | tuple[str, Mapping[str, Any]],
        *,
        next_method: str = "execute_complete",
        next_kwargs: Mapping[str, Any] | None = None,
        timeout: dt.timedelta | float | None = None,  # noqa: ASYNC109 - the trigger's deadline
        queue: str | None = None,
        defer_seq: int = 0,
        end_from_trigger: bool = False,
        resume: ResumeTarget | None = None,
        record_state: bool = True,
    ) -> DeferRequest:
        """Defer ``task`` (of any orchestrator) on ``trigger``, as a worker would.

        ``trigger`` is a trigger instance or its serialized ``(classpath, kwargs)``. With
        ``record_state`` the "deferred" task state is written first, so the scheduler (and
        ``deferline tasks``) track the task; events arrive on ``TopicNames.resume(queue)``
        keyed by the returned request's ``trigger_id``. Give ``resume`` to have a deferline
        worker resume the task.
        """
        if isinstance(trigger, tuple):
            classpath, kwargs = trigger
            trigger = SerializedTrigger(classpath, kwargs)
        deferral = TaskDeferred(
            trigger=trigger,
            method_name=next_method,
            kwargs=next_kwargs,
            timeout=timeout,
            end_from_trigger=end_from_trigger,
        )
        state, request = deferral_records(
            task, deferral, defer_seq=defer_seq, resume=resume, trigger_queue=queue, source="client"
        )
        await self._publish_deferral(
            state if record_state else None,
            request,
            worker_queue=resume.worker_queue if resume is not None else None,
        )
        return request

    async def cancel(
        self, target: str | TaskKey, *, queue: str | None = None, reason: str = "cancelled"
    ) -> CancelRequest:
        """Stop a trigger: by trigger id (looked up on ``queue``'s defer topic) or by task.

        The triggerer stops the trigger, tombstones it and emits a "cancelled" event.
        Raises :class:`TaskNotFound` when no such trigger is active (or the task is not
        deferred).
        """
        if isinstance(target, TaskKey):
            state = await self.get_state(target)
            if state is None or state.state != "deferred" or state.trigger_id is None:
                found = state.state if state is not None else "unknown"
                raise TaskNotFound(f"task {target.ti_key} is not deferred (state: {found})")
            cancel = CancelRequest(
                trigger_id=state.trigger_id,
                task=state.task,
                defer_seq=state.defer_seq,
                reason=reason,
            )
            queue = state.queue
        else:
            request = await self._find_request(target, queue)
            cancel = CancelRequest(
                trigger_id=request.trigger_id,
                task=request.task,
                defer_seq=request.defer_seq,
                reason=reason,
            )
        await self._ensure_topics(queues=(queue,) if queue else ())
        await self._send(self.names.defer(queue), cancel.trigger_id.encode(), encode(cancel))
        return cancel

    async def clear(self, task: TaskKey | str, *, reason: str = "cleared") -> TaskStateRecord:
        """Mark a task instance "removed"; if it is deferred, the scheduler cancels its trigger.

        The returned record names the trigger (``trigger_id``) when there was one to cancel.
        """
        current = await self.get_state(task)
        if current is None:
            raise TaskNotFound(f"no task {_ti_key(task)} on {self.names.tasks}")
        deferred = current.state == "deferred"
        record = TaskStateRecord(
            task=current.task,
            state="removed",
            trigger_id=current.trigger_id if deferred else None,
            defer_seq=current.defer_seq if deferred else 0,
            reason=reason,
            source="client",
            resume=current.resume,
            queue=current.queue,
        )
        await self._send(self.names.tasks, current.task.ti_key.encode(), encode(record))
        return record

    # -- reading -----------------------------------------------------------------------------

    async def get_state(self, task: TaskKey | str) -> TaskStateRecord | None:
        """The latest state of a task instance (any try), or None if it was never submitted."""
        key = _ti_key(task).encode()
        table = await self._read_tasks(key=key)
        return table.get(key.decode())

    async def list_tasks(
        self, *, state: TaskState | Iterable[TaskState] | None = None
    ) -> list[TaskStateRecord]:
        """Latest state of every task instance, sorted by key; optionally only some states."""
        wanted = {state} if isinstance(state, str) else set(state) if state is not None else None
        table = await self._read_tasks()
        return [table[key] for key in sorted(table) if wanted is None or table[key].state in wanted]

    async def _read_tasks(self, *, key: bytes | None = None) -> dict[str, TaskStateRecord]:
        table: dict[str, TaskStateRecord] = {}
        for record_key, value in (await self._read_table(self.names.tasks, key=key)).items():
            if value is None:
                continue
            try:
                record = decode(value)
            except SchemaError as exc:
                logger.warning("unreadable record on the tasks topic skipped: %s", exc)
                continue
            if isinstance(record, TaskStateRecord):
                table[record_key.decode(errors="replace")] = record
        return table

    async def _find_request(self, trigger_id: str, queue: str | None) -> DeferRequest:
        topic = self.names.defer(queue)
        value = (await self._read_table(topic, key=trigger_id.encode())).get(trigger_id.encode())
        record = decode(value) if value is not None else None
        if not isinstance(record, DeferRequest):
            raise TaskNotFound(f"no active trigger {trigger_id} on {topic}")
        return record

    async def _read_table(
        self, topic: str, *, key: bytes | None = None
    ) -> dict[bytes, bytes | None]:
        """Latest value per key of a (compacted) topic, read to its current end.

        With ``key``, only the partition that key hashes to is read.
        """
        described = await describe_topics(self.settings, [topic], configs=False)
        if not described:
            return {}
        count = described[0].partitions
        partitions = [partition_for(key, count)] if key is not None else list(range(count))
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer = make_consumer(self.settings, group_id=None)
        table: dict[bytes, bytes | None] = {}
        try:
            await start_client(consumer, grace=5.0, name="table reader")
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            while True:
                behind = [tp for tp in tps if await consumer.position(tp) < ends[tp]]
                if not behind:
                    break
                batches = await consumer.getmany(*behind, timeout_ms=200)
                for records in batches.values():
                    for record in records:
                        if record.key is None or (key is not None and record.key != key):
                            continue
                        table[record.key] = record.value
        except KafkaError as exc:
            raise ClientError(f"cannot read {topic}: {exc}") from exc
        finally:
            await stop_client(consumer, grace=5.0, name="table reader")
        return table

    # -- plumbing ----------------------------------------------------------------------------

    async def _publish_deferral(
        self, state: TaskStateRecord | None, request: DeferRequest, *, worker_queue: str | None
    ) -> None:
        """The "deferred" state first, then the (sealed) DeferRequest, each acknowledged."""
        await self._ensure_topics(
            queues=(request.queue,) if request.queue else (),
            worker_queues=(worker_queue,) if worker_queue else (),
        )
        if state is not None:
            await self._send(self.names.tasks, state.task.ti_key.encode(), encode(state))
        sealed = seal(request, self._cipher)
        await self._send(
            self.names.defer(request.queue), request.trigger_id.encode(), encode(sealed)
        )

    async def _send(self, topic: str, key: bytes, value: bytes) -> None:
        if self._producer is None:
            raise ClientError("the client is not started (use `async with Client(...)`)")
        try:
            await self._producer.send_and_wait(topic, value=value, key=key)
        except KafkaError as exc:
            raise ClientError(f"cannot publish to {topic}: {exc}") from exc

    async def _ensure_topics(
        self, *, queues: Iterable[str] = (), worker_queues: Iterable[str] = ()
    ) -> None:
        if not self._ensure:
            return
        wanted = (tuple(sorted(queues)), tuple(sorted(worker_queues)))
        if wanted in self._ensured:
            return
        await ensure_topics(
            self.settings, topic_specs(self.settings, queues=wanted[0], worker_queues=wanted[1])
        )
        self._ensured.add(wanted)


def _import_quietly(classpath: str) -> type[BaseOperator] | None:
    """The operator class if it is importable here, else None (the worker may still have it)."""
    module_name, _, name = classpath.rpartition(".")
    prepare_airflow_import()  # the module may defer on Airflow's triggers
    try:
        module = importlib.import_module(module_name)
    except Exception:
        return None
    cls = getattr(module, name, None)
    if isinstance(cls, type) and issubclass(cls, BaseOperator):
        return cls
    return None
