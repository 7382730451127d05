"""``AirflowBridge``: Airflow's triggerer as Airflow sees it, deferline's triggerers doing the work.

Three loops, the database reached from worker threads (Airflow's models are synchronous): one
for the job row and the claims, ``writers`` for the write-back.

* the **heartbeat** of the ``TriggererJob`` row, every ``[triggerer] job_heartbeat_sec``;
* the **claim loop**, once per ``poll_interval`` as Airflow's triggerer loops: claim rows
  (``Trigger.assign_unassigned``), publish a DeferRequest for each new row on the bridge
  prefix's defer topic (or fail its task instance when the row cannot run), a WatchRequest
  for each asset watcher (Airflow 3), cancel in deferline the rows Airflow deleted (a
  watch: its tombstone), run ``clean_unused``;
* the **event loop**: the consumer group ``<prefix>bridge`` on the resume topics, each batch
  of events written back into Airflow in one transaction, up to ``writers`` batches at once,
  offsets committed in order once a batch and all before it are written; the next batch is
  read while others are written, so a batch is what arrived during the writes before it
  (``write_back_loop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError
from deferline.engine._watchdog import BlockedLoop, LoopWatchdog
from deferline.schemas import (
    DeadLetter,
    KwargsCipher,
    SchemaError,
    TriggerLogRecord,
    decode_as,
    encode,
)
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
    trigger_logs_spec,
)

from .._aiokafka import leave_from_generation_zero
from .._metrics import MetricsServer
from ._airflow_db import AirflowDatabase
from ._airflow_watches import AirflowWatches
from ._book import RowBook
from ._metrics import BridgeMetrics
from ._rows import (
    BridgeEvent,
    RejectedRow,
    RowRef,
    WatchApply,
    WatchRow,
    bridge_event,
    read_event,
    to_defer_request,
    to_watch_request,
)
from ._services import AirflowServices, requests_for_this_airflow
from ._state import BridgeLifecycle, BridgeState
from ._trigger_logs import LOOK_BACK, LogServer, TriggerLogFiles, upload_to_remote
from ._write_back import CleanUpSchedule, write_back_loop

__all__ = ["AirflowBridge", "BridgeOptions"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
E = TypeVar("E")
ReadRecord = tuple[Any, BridgeEvent | WatchApply | SchemaError | None]
"""A record of the resume topic, and what to write back for it or why it is not an event."""
CLEAN_UP_WAITS_S = 30.0
"""The longest ``clean_unused`` waits for the write-back to pause (:class:`CleanUpSchedule`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BridgeOptions:
    """How one bridge behaves.

    Args:
        capacity: rows this bridge claims at most (Airflow's ``--capacity``). The triggers
            run in deferline's triggerers, not here, so the default is far above Airflow's
            1,000.
        claim_per_loop: rows one claim takes at most per kind (Airflow's
            ``max_trigger_to_select_per_loop``, 50 there).
        queues: Airflow trigger queues to serve (3.2+); empty serves rows without a queue.
        team_name: the Airflow team to serve (3.3+ with ``[core] multi_team``).
        poll_interval: seconds between claim loops (Airflow's triggerer: about 1).
        max_events: events written back per database transaction at most.
        writers: batches written back at once, each in its own session and transaction (on
            SQLite, one writer at a time in any case).
        metrics_port: serve Prometheus metrics on this port; None: no endpoint.
        services_port: answer Airflow triggers' runtime requests (connections, variables,
            XCom, task and DAG-run state, human-in-the-loop) on this port, for triggerers
            given ``DEFERLINE_AIRFLOW_SERVICES``; None: not served. Airflow 3 only.
        services_threads: requests answered at once (1 on SQLite).
        trigger_logs: write the trigger log lines the triggerers ship where Airflow's UI
            reads them, serve them with Airflow's log server, upload them with its remote log
            handler (see :mod:`._trigger_logs`).
    """

    capacity: int = 100_000
    claim_per_loop: int = 5_000
    queues: tuple[str, ...] = ()
    team_name: str | None = None
    poll_interval: float = 1.0
    max_events: int = 5_000
    writers: int = 1
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    services_port: int | None = None
    services_host: str = "0.0.0.0"
    services_threads: int = 4
    trigger_logs: bool = False
    stop_timeout: float = 10.0


class AirflowBridge(Lifecycle):
    """One bridge process: ``async with AirflowBridge(settings, options): ...``.

    ``settings.topic_prefix`` is the bridge's own prefix (``deferline.airflow.`` by default
    from the CLI), which deferline's own scheduler never reads.
    """

    def __init__(
        self,
        settings: Settings,
        options: BridgeOptions | None = None,
        *,
        database: AirflowDatabase | None = None,
    ) -> None:
        self.settings = settings
        self.options = options = options or BridgeOptions()
        if min(options.capacity, options.claim_per_loop, options.max_events, options.writers) < 1:
            raise ValueError("capacity, claim_per_loop, max_events and writers must be at least 1")
        self.names = TopicNames(settings.topic_prefix)
        self.group_id = f"{settings.topic_prefix}bridge"
        self.lifecycle = BridgeLifecycle()
        self.book = RowBook()
        self.db = database
        self.watches: AirflowWatches | None = None
        """Asset watchers (Airflow 3; None on 2.10, which has none)."""
        self._cipher = KwargsCipher(settings.kwargs_keys) if settings.kwargs_keys else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="airflow-db")
        self._writers: ThreadPoolExecutor | None = None  # the write-back's, made at start
        self.writers = 1
        self.metrics: BridgeMetrics | None = None
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._server: MetricsServer | None = None
        self.services: AirflowServices | None = None
        self._watchdog: LoopWatchdog | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._log_files: TriggerLogFiles | None = None
        self._log_server: LogServer | None = None
        self._log_consumer: AIOKafkaConsumer | None = None
        self._clean_up = CleanUpSchedule(quiet=options.poll_interval, longest=CLEAN_UP_WAITS_S)

    @property
    def state(self) -> BridgeState:
        return self.lifecycle.state

    async def _db(self, call: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, call, *args)

    # Lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self.state is not BridgeState.NEW:
            return
        self.lifecycle.move(BridgeState.STARTING)
        options = self.options
        if self.db is None:
            self.db = await self._db(
                lambda: AirflowDatabase(queues=options.queues, team_name=options.team_name)
            )
        db = self.db
        self.writers = writers = 1 if db.dialect == "sqlite" else options.writers
        self._writers = ThreadPoolExecutor(writers, thread_name_prefix="airflow-db-write")
        if not db.version.startswith("2."):
            self.watches = watches = AirflowWatches(db)
            await self._db(watches.create_table)
        job_id = await self._db(db.start_job)
        self.metrics = metrics = BridgeMetrics(hostname=db.hostname, capacity=options.capacity)
        queues: Sequence[str | None] = options.queues or (None,)
        wanted = {self.names.defer(q) for q in queues} | {self.names.resume(q) for q in queues}
        specs = topic_specs(self.settings, queues=[q for q in queues if q])
        await ensure_topics(
            self.settings, [s for s in specs if s.name in wanted or s.name == self.names.dead]
        )
        self._producer = make_producer(self.settings)
        await start_client(self._producer, grace=5.0, name="bridge producer")
        self._consumer = make_consumer(
            self.settings, *sorted(self.names.resume(q) for q in queues), group_id=self.group_id
        )
        await start_client(self._consumer, grace=5.0, name="bridge consumer")
        leave_from_generation_zero(self._consumer)
        if options.metrics_port is not None:
            self._server = MetricsServer(
                metrics.registry, host=options.metrics_host, port=options.metrics_port
            )
            await self._server.start()
        if options.services_port is not None:
            requests = await self._db(lambda: requests_for_this_airflow(options.team_name))
            self.services = AirflowServices(
                requests,
                metrics=metrics,
                cipher=self._cipher,
                threads=1 if db.dialect == "sqlite" else options.services_threads,
                host=options.services_host,
                port=options.services_port,
            )
            await self.services.start()
        self._watchdog = LoopWatchdog(
            threshold=0.2, describe=_describe_task, on_blocked=self._blocked
        )
        self._watchdog.start()
        self._loops = [
            asyncio.create_task(self._heartbeat_loop(), name="airflow-bridge-heartbeat"),
            asyncio.create_task(self._claim_loop(), name="airflow-bridge-claim"),
            asyncio.create_task(self._event_loop(), name="airflow-bridge-events"),
        ]
        if options.trigger_logs:
            await self._start_trigger_logs(db, job_id)
        self.lifecycle.move(BridgeState.RUNNING)
        logger.info(
            "Airflow bridge running",
            extra={
                "metrics_port": self._server.port if self._server is not None else None,
                "services_port": self.services.port if self.services is not None else None,
                "airflow": db.version,
                "job_id": job_id,
                "prefix": self.settings.topic_prefix,
                "queues": list(options.queues),
                "capacity": options.capacity,
                "writers": writers,
            },
        )

    async def wait(self) -> None:
        """Wait until a loop stops by itself, and raise what stopped it."""
        done, _ = await asyncio.wait(self._loops, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                if self.lifecycle.can_move(BridgeState.FAILED):
                    self.lifecycle.move(BridgeState.FAILED)
                raise task.exception()  # type: ignore[misc]

    async def stop(self) -> None:
        if self.state in (BridgeState.STOPPING, BridgeState.STOPPED):
            return
        if self.state is BridgeState.NEW:
            self.lifecycle.move(BridgeState.STOPPED)
            return
        self.lifecycle.move(BridgeState.STOPPING)
        for task in self._loops:
            task.cancel()
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._log_consumer is not None:
            await stop_client(self._log_consumer, grace=self.options.stop_timeout, name="logs")
        if self._log_server is not None:
            await asyncio.to_thread(self._log_server.stop)
        if self.services is not None:
            await self.services.stop()
        grace = self.options.stop_timeout
        if self._consumer is not None:
            await stop_client(self._consumer, grace=grace, name="consumer")
        if self._producer is not None:
            await stop_client(self._producer, grace=grace, name="producer")
        if self._server is not None:
            await self._server.stop()
        if self._watchdog is not None:
            await self._watchdog.stop()
        if self.db is not None:
            try:
                await self._db(self.db.end_job)
            except Exception:
                logger.exception("could not mark the TriggererJob row finished")
        self._thread.shutdown(wait=False)
        if self._writers is not None:
            self._writers.shutdown(wait=False)
        self.lifecycle.move(BridgeState.STOPPED)
        logger.info("Airflow bridge stopped")

    # Trigger logs --------------------------------------------------------------------------

    async def _start_trigger_logs(self, db: AirflowDatabase, job_id: int) -> None:
        """Read ``trigger.logs`` from :data:`LOOK_BACK` ago, write the lines of this bridge's
        rows, and serve them as Airflow's triggerer serves its own."""
        spec = trigger_logs_spec(self.settings)
        await ensure_topics(self.settings, [spec])
        self._log_files = TriggerLogFiles(
            base_folder=db.base_log_folder,
            job_id=job_id,
            task_log_path=db.task_log_path,
            holds=self.book.holds,
            airflow2=db.version.startswith("2."),
        )
        self._log_server = LogServer(db.trigger_log_server_port)
        await asyncio.to_thread(self._log_server.start)
        consumer = make_consumer(self.settings, group_id=None)
        self._log_consumer = consumer
        await start_client(consumer, grace=5.0, name="bridge trigger-logs consumer")
        await consumer._client.force_metadata_update()
        partitions = [
            TopicPartition(spec.name, p)
            for p in sorted(consumer.partitions_for_topic(spec.name) or ())
        ]
        consumer.assign(partitions)
        since = int((time.time() - LOOK_BACK.total_seconds()) * 1000)
        found = await consumer.offsets_for_times({tp: since for tp in partitions})
        ends = await consumer.end_offsets(partitions)
        for tp in partitions:
            hit = found.get(tp)
            consumer.seek(tp, hit.offset if hit is not None else ends[tp])
        self._loops.append(asyncio.create_task(self._log_loop(), name="airflow-bridge-logs"))
        logger.info(
            "trigger logs written and served",
            extra={"port": self._log_server.port, "folder": db.base_log_folder},
        )

    async def _log_loop(self) -> None:
        consumer, files = self._log_consumer, self._log_files
        assert consumer is not None
        assert files is not None
        while True:
            batches = await consumer.getmany(timeout_ms=500, max_records=2_000)
            records = []
            for message in (m for ms in batches.values() for m in ms):
                try:
                    record = decode_as(message.value, TriggerLogRecord)
                except SchemaError as exc:
                    logger.warning("not a trigger log record on %s: %s", message.topic, exc)
                    continue
                records.append(record)
            if records:
                await self._db(files.write, records)

    async def _logs_done(self, row_ids: set[int]) -> None:
        """These rows left this bridge: upload their trigger log files (a remote handler)."""
        files = self._log_files
        if files is None:
            return
        for relative in files.done(row_ids):
            try:
                await self._db(upload_to_remote, relative)
            except Exception:
                logger.exception("trigger log not uploaded", extra={"path": relative})

    def _blocked(self, episode: BlockedLoop) -> None:
        if not episode.ended and self.metrics is not None:
            self.metrics.blocked_main_thread.inc()

    # Claim loop -------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """The job row's heartbeat, on its own clock: a long claim or batch does not delay it
        past ``job_heartbeat_sec`` more than the one database call in flight."""
        db, _ = self._require()
        while True:
            await asyncio.sleep(db.heartrate)
            try:
                await self._db(db.heartbeat)
            except db.transient as exc:  # the database busy or away for a moment: next beat
                logger.warning("heartbeat: Airflow's database failed: %s", exc)

    async def _claim_loop(self) -> None:
        db, _ = self._require()
        while True:
            try:
                await self.claim_once()
            except db.transient as exc:  # the database away for a moment: try again
                logger.warning("claim loop: Airflow's database failed: %s", exc)
            await asyncio.sleep(self.options.poll_interval)

    async def claim_once(self) -> None:
        """One pass of the claim loop (public for tests)."""
        db, metrics = self._require()
        options = self.options
        owned = await self._db(db.claim, options.capacity, options.claim_per_loop)
        unseen = self.book.unseen(owned)
        if unseen:
            await self._hand_over(db, unseen)
        vanished = self.book.vanished(owned)
        if vanished:
            await self._logs_done(vanished)
            deleted = vanished - await self._db(db.existing, vanished)
            stops = self.book.settle(vanished, deleted)
            await self._send_all(
                (
                    self.names.defer(s.queue),
                    s.trigger_id,
                    None if s.cancel is None else encode(s.cancel),
                )
                for s in stops
            )
            for stop in stops:
                logger.info(
                    "trigger cancelled: Airflow removed its row"
                    if stop.cancel is not None
                    else "watch tombstoned: Airflow removed its row",
                    extra={
                        "trigger_id": stop.trigger_id,
                        "task": None if stop.cancel is None else str(stop.cancel.task),
                    },
                )
        now = asyncio.get_running_loop().time()
        if self._clean_up.due(now):
            await self._db(db.clean_unused)
            if self.watches is not None:
                await self._db(self.watches.forget_applied)
            self._clean_up.cleaned(now)
        metrics.set_running(len(self.book))

    async def _hand_over(self, db: AirflowDatabase, ids: set[int]) -> None:
        rows, others = await self._db(db.read_rows, ids)
        if others and self.watches is not None:
            watches, others = await self._db(self.watches.read, others)
            await self._hand_over_watches(watches)
        if others:
            # Needed by nothing any more (a callback that ended): clean_unused deletes them.
            await self._db(db.release, others)
        outcomes = [
            to_defer_request(
                row, allowed_prefixes=self.settings.allowed_trigger_prefixes, cipher=self._cipher
            )
            for row in rows
        ]
        rejected = [o for o in outcomes if isinstance(o, RejectedRow)]
        requests = [o for o in outcomes if not isinstance(o, RejectedRow)]
        # Said before it is written: a stop between the write and the line would leave a
        # failed row no log explains (a row failed twice is said twice, which is harmless).
        for r in rejected:
            logger.warning("trigger row failed: %s", r.reason, extra={"row_id": r.ref.row_id})
        await self._send_all((self.names.defer(r.queue), r.trigger_id, encode(r)) for r in requests)
        for row, outcome in zip(rows, outcomes, strict=True):
            self.book.handed(row.ref, None if isinstance(outcome, RejectedRow) else outcome)
        if rejected:
            await self._db(db.fail_rows, [(r.ref, r.reason) for r in rejected])
            self._require()[1].failed.inc(len(rejected))

    async def _hand_over_watches(self, watches: Sequence[WatchRow]) -> None:
        """Publish a WatchRequest for each asset watcher or callback row. One that cannot run
        is said in the log once and kept; a callback's is recorded failed, with the reason."""
        allowed = self.settings.allowed_trigger_prefixes
        outcomes = [
            to_watch_request(w, allowed_prefixes=allowed, cipher=self._cipher) for w in watches
        ]
        failed_callbacks: list[tuple[RowRef, str]] = []
        for watch, outcome in zip(watches, outcomes, strict=True):
            if isinstance(outcome, RejectedRow):
                kind = "deadline-alert callback" if watch.callback else "asset watcher"
                logger.warning(
                    "%s row cannot run: %s",
                    kind,
                    outcome.reason,
                    extra={"row_id": outcome.ref.row_id},
                )
                if watch.callback:
                    failed_callbacks.append((outcome.ref, str(outcome.reason)))
        requests = [o for o in outcomes if not isinstance(o, RejectedRow)]
        await self._send_all((self.names.defer(r.queue), r.trigger_id, encode(r)) for r in requests)
        for watch, outcome in zip(watches, outcomes, strict=True):
            self.book.handed(watch.ref, None if isinstance(outcome, RejectedRow) else outcome)
        if requests:
            logger.info(
                "watches published",
                extra={"trigger_ids": [r.trigger_id for r in requests]},
            )
        if failed_callbacks and self.watches is not None:
            await self._db(self.watches.fail_callbacks, failed_callbacks)
            self._require()[1].failed.inc(len(failed_callbacks))

    async def _send_all(self, records: Any) -> None:
        """Send ``(topic, key, value)`` records and wait until the broker has them all."""
        producer = self._producer
        assert producer is not None
        pending = [
            await producer.send(topic, value, key=key.encode()) for topic, key, value in records
        ]
        if pending:
            await asyncio.gather(*pending)

    # Event loop -------------------------------------------------------------------------

    async def _event_loop(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        await write_back_loop(
            consumer,
            self._write_back,
            self._commit,
            max_records=self.options.max_events,
            writers=self.writers,
            read=_read_event,
        )

    async def _write_back(self, records: list[ReadRecord]) -> None:
        """Write one batch of records (each with what :func:`_read_event` made of it) back into
        Airflow."""
        self._clean_up.write_started()
        try:
            await self._write_events(records)
        finally:
            self._clean_up.write_ended(asyncio.get_running_loop().time())

    async def _write_events(self, records: list[ReadRecord]) -> None:
        events: list[BridgeEvent] = []
        watch_events: list[WatchApply] = []
        for message, event in records:
            if isinstance(event, SchemaError):
                await self._dead_letter(message, event)
            elif isinstance(event, WatchApply):
                watch_events.append(event)
            elif event is not None:
                events.append(event)
        if events:
            await self._until_written(self.apply, events)
        if watch_events:
            await self._until_written(self.apply_watch_events, watch_events)

    async def _until_written(
        self, apply: Callable[[list[E]], Awaitable[None]], batch: list[E]
    ) -> None:
        """``apply(batch)``, again while the database fails for a moment (nothing committed)."""
        while True:
            try:
                await apply(batch)
                return
            except self._require()[0].transient as exc:
                logger.warning("write-back failed, retrying: %s", exc)
                await asyncio.sleep(self.options.poll_interval)

    async def _commit(self, records: list[ReadRecord]) -> None:
        """Commit the offsets of a written batch (every batch before it is written too)."""
        consumer = self._consumer
        assert consumer is not None
        offsets: dict[TopicPartition, int] = {}
        for message, _ in records:
            tp = TopicPartition(message.topic, message.partition)
            offsets[tp] = max(offsets.get(tp, 0), message.offset + 1)
        try:
            await consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # A rebalance took the partitions: the new owner applies the batch again,
            # and Airflow's guard keeps the second application from changing anything.
            logger.warning("offsets not committed: %r", exc)

    async def apply(self, events: Sequence[BridgeEvent]) -> None:
        """Write events back into Airflow in one transaction, and count them."""
        db, metrics = self._require()
        assert self._writers is not None
        result = await asyncio.get_running_loop().run_in_executor(self._writers, db.apply, events)
        self.book.applied(result.rows)
        metrics.succeeded.inc(result.succeeded)
        metrics.failed.inc(result.failed)
        if result.timed_out:
            logger.info("%d trigger timeout(s) written back", result.timed_out)
        if result.stale:
            logger.info("%d event(s) of rows Airflow no longer has: skipped", result.stale)

    async def apply_watch_events(self, events: Sequence[WatchApply]) -> None:
        """Write asset watchers' events back into Airflow, each exactly once, and count them."""
        _, metrics = self._require()
        if self.watches is None:  # Airflow 2.10 has no watchers: no bridge published one
            logger.warning("%d watch event(s) on an Airflow without asset watchers", len(events))
            return
        assert self._writers is not None
        result = await asyncio.get_running_loop().run_in_executor(
            self._writers, self.watches.apply, events
        )
        metrics.succeeded.inc(result.fired)
        metrics.failed.inc(result.failed)
        if result.repeated:
            logger.info("watch events applied before: skipped", extra={"events": result.repeated})
        if result.stale:
            logger.info(
                "watch events of rows Airflow no longer has: skipped",
                extra={"events": result.stale},
            )

    async def _dead_letter(self, message: Any, exc: SchemaError) -> None:
        letter = DeadLetter(
            topic=message.topic,
            partition=message.partition,
            offset=message.offset,
            key=message.key,
            value=message.value,
            error=str(exc),
            error_type=type(exc).__name__,
        )
        await self._send_all([(self.names.dead, message.topic, encode(letter))])
        logger.warning("not a trigger event on %s: dead-lettered (%s)", message.topic, exc)

    def _require(self) -> tuple[AirflowDatabase, BridgeMetrics]:
        if self.db is None or self.metrics is None:
            raise RuntimeError("the bridge is not started")
        return self.db, self.metrics


def _read_event(message: Any) -> ReadRecord:
    """A record of the resume topic with what to write back for it (:func:`bridge_event`), or
    why it is not a trigger event (dead-lettered when its batch is written)."""
    try:
        return message, bridge_event(read_event(message.value))
    except SchemaError as exc:
        return message, exc


def _describe_task(task: asyncio.Task[object] | None) -> tuple[str | None, str]:
    return None, task.get_name() if task is not None else "the bridge's event loop"
