"""The triggerer process: consumer-group members that run triggers, and its CLI command.

One process runs one :class:`~deferline.engine.TriggerSupervisor` (shared capacity), one
batching producer pipeline, and one consumer-group member ("lane") per trigger queue it
serves. Which triggers it runs is decided by partition assignment: adding a process scales
out, a crash is healed by a rebalance. See docs/operations.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click
from deferline.engine import (
    TriggerOutcome,
    TriggerSupervisor,
    close_airflow_services,
    preload_airflow,
    use_airflow_services,
)
from deferline.schemas import DeferlineError, KwargsCipher
from deferline.topics import (
    Lifecycle,
    Settings,
    TopicNames,
    describe_topics,
    ensure_topics,
    make_producer,
    run_closing,
    start_client,
    stop_client,
    topic_specs,
    trigger_logs_spec,
    use_home_settings,
    validate_queue_name,
)
from prometheus_client import CollectorRegistry

from .._gc import collect_less_often
from .._local_state import state_home
from .._metrics import MetricsServer
from .._options import (
    TRANSACTIONS,
    connection_options,
    group_timing_options,
    logging_options,
    metrics_options,
    outage_option,
    transactions_option,
)
from .._outage import ride_out
from .._signals import STOP_SIGNALS, run_until_signal
from ..member import choose_fetch_wait
from ._checkpoint import CheckpointStore, MemoryCheckpointStore, RocksCheckpointStore
from ._emitter import Emitter
from ._lane import (
    BootstrapError,
    LaneOptions,
    TopicDeletedError,
    TriggererError,
    TriggerLane,
    TriggerRef,
)
from ._metrics import TriggererMetrics
from ._source_offsets import SourceOffsets
from ._trigger_logs import TriggerLogShipper

__all__ = [
    "DEFAULT_CAPACITY",
    "BootstrapError",
    "TopicDeletedError",
    "Triggerer",
    "TriggererError",
    "TriggererOptions",
    "default_member",
    "default_state_dir",
    "triggerer_command",
]

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 10_000
"""Triggers run at once per process. Ten times Airflow's 1,000: a timer costs far less than a
coroutine trigger (docs/benchmarks.md, the engine's figures), and partition ownership is not
load-aware, so a member should run what it owns rather than hold it back."""


def default_member() -> str:
    """``hostname-pid``: unique per process, readable in events and logs."""
    return f"{socket.gethostname()}-{os.getpid()}"


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/deferline/triggerer`` (``~/.local/state/...`` when unset)."""
    return state_home() / "triggerer"


@dataclass(frozen=True, kw_only=True)
class TriggererOptions:
    """How one triggerer process behaves (every default is what ``deferline triggerer`` uses).

    Attributes:
        capacity: triggers running at once (see :data:`DEFAULT_CAPACITY`); more wait.
        queues: trigger queues served; ``None`` (or ``"default"``) is the default queue.
        member: name in events and logs; default :func:`default_member`.
        static: join as a static member (KIP-345) with ``member`` as ``group.instance.id``:
            restarted within the session timeout, the process gets its partitions back
            without a rebalance (and rebuilds them from its checkpoint). A static member
            does not leave the group when it stops: its partitions wait for it (or for the
            session timeout). Needs an explicit, stable ``member``.
        state_dir: where partition checkpoints live; ``None`` keeps them in memory only
            (a restart then rebuilds from the topics).
        direct_resume: also produce ``RunTask(mode="resume")`` for fired triggers whose
            DeferRequest carries ``resume`` (the event is marked ``resumed_directly``).
        transactions: write the owned partitions' events, their tasks.events copies and
            tombstones in Kafka transactions, one round at a time per queue through one
            transactional producer, with the group's generation (True; a broker without
            KIP-447 is an error), never (False), or when the broker has them (None). With
            them a reader in ``read_committed`` sees every event once and a paused old
            owner is fenced by the group (see :class:`~deferline.runners.member.MemberProducer`).
        max_pending: pause fetching while pending triggers plus unsent events exceed this;
            resume below half of it. Default: ten times the capacity (a memory guard
            against floods: while paused, cancels and new deferrals wait in Kafka too).
        max_unsent: events queued for the producer at which due timers stop firing; they
            fire again, in order, once half of them are acked. Bounds the memory of a burst
            (a million timers due at once) without dropping or reordering anything.
        session_timeout_ms / heartbeat_interval_ms: consumer-group liveness; a crashed
            member's partitions move after the session timeout. The other members hear of
            a rebalance (a join, a leave) at their next heartbeat, so the interval is part
            of the pause of every rebalance (docs/design.md, its cost).
        fetch_max_wait_ms: broker-side fetch wait of the group consumer; ``None`` (default)
            chooses at start from the brokers' ApiVersions answer: 500 ms on Apache Kafka,
            which answers as soon as a record arrives (a long poll costs no latency and keeps
            an idle member quiet), 20 ms on Tansu, which holds every fetch this long (the
            latency floor there). See :func:`deferline.runners.member.choose_fetch_wait`.
        checkpoint_interval: seconds between checkpoints (and commits) of owned partitions.
        checkpoint_max_age: an older checkpoint is ignored (compaction may have removed
            tombstones it has not seen; keep it below the topic's ``delete.retention.ms``).
        resume_skew_margin: without a checkpoint, the resume topic is scanned from this many
            seconds before the oldest active deferral (covers clock skew).
        flush_timeout: bound on flushing sends when partitions are revoked or at shutdown.
        cleanup_timeout: bound on each trigger's ``cleanup()``.
        block_threshold: report the loop as blocked after this many seconds (None: off).
        create_topics: create missing topics at start (idempotent).
        trigger_logs: ship each trigger's own log lines to the ``trigger.logs`` topic, where
            the Airflow bridge writes them for Airflow's UI (see :mod:`._trigger_logs`).
        metrics_port: serve Prometheus metrics on this port (0: any free port; None: off).
        metrics_host: interface for the metrics endpoint.
    """

    capacity: int = DEFAULT_CAPACITY
    queues: tuple[str | None, ...] = (None,)
    member: str | None = None
    static: bool = False
    state_dir: Path | None = None
    direct_resume: bool = False
    transactions: bool | None = None
    max_pending: int | None = None
    max_unsent: int = 10_000
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 250
    fetch_max_wait_ms: int | None = None
    checkpoint_interval: float = 5.0
    checkpoint_max_age: float = 12 * 3600.0
    resume_skew_margin: float = 600.0
    flush_timeout: float = 10.0
    cleanup_timeout: float = 5.0
    block_threshold: float | None = 0.2
    create_topics: bool = True
    trigger_logs: bool = False
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"


def _normalise_queues(queues: Sequence[str | None]) -> tuple[str | None, ...]:
    seen: list[str | None] = []
    for queue in queues or (None,):
        name = None if queue in (None, "", "default") else validate_queue_name(str(queue))
        if name not in seen:
            seen.append(name)
    return tuple(seen)


async def _partition_count(settings: Settings, topic: str) -> int:
    """The partition count of ``topic``; TriggererError when it does not exist."""
    found = await describe_topics(settings, [topic], configs=False)
    if not found:
        raise TriggererError(
            f"topic {topic} does not exist: every trigger event is also written there, for "
            "the scheduler owning its task; create it with `deferline topics ensure`"
        )
    return found[0].partitions


class Triggerer(Lifecycle):
    """A triggerer process: ``async with Triggerer(settings, options): ...`` or :meth:`run`.

    Stopping (``stop()``, or SIGTERM/SIGINT under :meth:`run`) stops fetching, cancels the
    running triggers with cleanup, flushes sends, writes checkpoints, commits and leaves
    the group, so the other members take the partitions over at once.
    """

    def __init__(
        self,
        settings: Settings,
        options: TriggererOptions | None = None,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.options = options or TriggererOptions()
        if self.options.capacity < 1:
            raise ValueError("capacity must be at least 1")
        if self.options.max_unsent < 1:
            raise ValueError("max_unsent must be at least 1")
        self.member = self.options.member or default_member()
        if self.options.static and not self.options.member:
            raise ValueError("static membership needs an explicit, stable member name")
        self.queues = _normalise_queues(self.options.queues)
        self.metrics = TriggererMetrics(registry, member=self.member)
        self._stop_requested = asyncio.Event()
        self._fatal: BaseException | None = None
        self._producer: Any = None
        self._supervisor: TriggerSupervisor | None = None
        self._emitter: Emitter | None = None
        self._source_offsets = SourceOffsets(self.settings)
        self._log_shipper: TriggerLogShipper | None = None
        self._store: CheckpointStore | None = None
        self._server: MetricsServer | None = None
        self._lanes: list[TriggerLane] = []
        self._fetchers: list[asyncio.Task[None]] = []
        self._cancels: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
        self._reaper: asyncio.Task[None] | None = None
        self._started = False
        self._stopped = False
        self.fetch_max_wait_ms: int | None = None
        """The fetch wait in use (after start): the configured one, or the one chosen."""

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def lanes(self) -> list[TriggerLane]:
        """One lane per served queue."""
        return list(self._lanes)

    @property
    def supervisor(self) -> TriggerSupervisor:
        """The process's trigger supervisor (after start)."""
        assert self._supervisor is not None, "start() first"
        return self._supervisor

    @property
    def peak_unsent(self) -> int:
        """The most events that ever waited for the producer at once (see ``max_unsent``)."""
        return self._emitter.peak_backlog if self._emitter is not None else 0

    @property
    def metrics_port(self) -> int | None:
        """The bound metrics port, when serving."""
        return self._server.port if self._server is not None else None

    async def start(self) -> None:
        """Connect, join the groups and start fetching."""
        if self._started:
            return
        self._started = True
        options = self.options
        settings = self.settings
        use_home_settings(settings)  # the cluster of the triggers that read Kafka
        if settings.airflow_services:
            # Process-wide, as Airflow's SUPERVISOR_COMMS is.
            use_airflow_services(
                settings.airflow_services,
                timeout=settings.airflow_services_timeout,
                cipher=KwargsCipher(settings.kwargs_keys) if settings.kwargs_keys else None,
            )
        # Airflow's import takes seconds: do it off the loop, before joining the group.
        await asyncio.to_thread(preload_airflow, settings.allowed_trigger_prefixes)
        if options.metrics_port is not None:
            self._server = MetricsServer(
                self.metrics.registry, host=options.metrics_host, port=options.metrics_port
            )
            await self._server.start()
        if options.create_topics:
            named = [q for q in self.queues if q is not None]
            await ensure_topics(self.settings, topic_specs(self.settings, queues=named))
        task_partitions = (
            await _partition_count(
                self.settings, TopicNames(self.settings.topic_prefix).task_events
            )
            if self.settings.copy_events_to_tasks
            else None
        )
        cipher = KwargsCipher(self.settings.kwargs_keys) if self.settings.kwargs_keys else None
        self._producer = make_producer(
            self.settings, client_id=self.member, linger_ms=1, max_batch_size=256 * 1024
        )
        await start_client(self._producer, grace=5.0, name="triggerer producer")
        self.fetch_max_wait_ms = await choose_fetch_wait(
            self.settings, options.fetch_max_wait_ms, client=self._producer.client
        )
        if options.trigger_logs:
            await self._ship_trigger_logs()
        self._supervisor = TriggerSupervisor(
            capacity=options.capacity,
            on_event=self._on_outcome,
            cleanup_timeout=options.cleanup_timeout,
            block_threshold=options.block_threshold,
        )
        await self._supervisor.start()
        self._emitter = Emitter(
            self._producer,
            max_backlog=options.max_unsent,
            on_pressure=self._supervisor.hold_timers,
            source_offsets=self._source_offsets,
        )
        await self._emitter.start()
        mismatches = self.metrics.checkpoint_mismatches.inc
        self._store = (
            RocksCheckpointStore(options.state_dir, on_mismatch=mismatches)
            if options.state_dir is not None
            else MemoryCheckpointStore(on_mismatch=mismatches)
        )
        self._reaper = asyncio.create_task(self._reap(), name="trigger-reaper")
        lane_options = LaneOptions(
            member=self.member,
            direct_resume=options.direct_resume,
            session_timeout_ms=options.session_timeout_ms,
            heartbeat_interval_ms=options.heartbeat_interval_ms,
            fetch_max_wait_ms=self.fetch_max_wait_ms,
            checkpoint_interval=options.checkpoint_interval,
            checkpoint_max_age=options.checkpoint_max_age,
            resume_skew_margin=options.resume_skew_margin,
            flush_timeout=options.flush_timeout,
            group_instance_id=self.member if options.static else None,
        )
        for queue in self.queues:
            lane = TriggerLane(
                self.settings,
                queue=queue,
                options=lane_options,
                supervisor=self._supervisor,
                emitter=self._emitter,
                transactions=options.transactions,
                store=self._store,
                metrics=self.metrics,
                cipher=cipher,
                cancel=self._stop_trigger,
                on_fatal=self._on_fatal,
                task_partitions=task_partitions,
            )
            lane.set_max_pending(options.max_pending or 10 * options.capacity)
            self.metrics.members.add(lane.figures, lane.label)
            self._lanes.append(lane)
            await lane.start()
        supervisor, emitter = self._supervisor, self._emitter
        self.metrics.watch(
            supervisor=supervisor.metrics.snapshot,
            fire_lag=lambda: supervisor.metrics.fire_lag,
            partitions=lambda: [row for lane in self._lanes for row in lane.partitions()],
            backlog=lambda: emitter.backlog,
        )
        for lane in self._lanes:
            task = asyncio.create_task(lane.run(self._stop_requested), name=f"fetch-{lane.label}")
            task.add_done_callback(self._fetcher_done)
            self._fetchers.append(task)
        logger.info(
            "triggerer started",
            extra={
                "member": self.member,
                "queues": [lane.label for lane in self._lanes],
                "capacity": options.capacity,
                "static": options.static,
                "fetch_max_wait_ms": self.fetch_max_wait_ms,
                "state_dir": str(options.state_dir) if options.state_dir else None,
                "metrics_port": self.metrics_port,
            },
        )

    def request_stop(self) -> None:
        """Ask the process to stop (signal-handler safe)."""
        self._stop_requested.set()

    async def wait(self) -> None:
        """Wait until a stop is requested or something fatal happens (raised as
        :class:`TriggererError`)."""
        await self._stop_requested.wait()
        if self._fatal is not None:
            raise TriggererError(str(self._fatal)) from self._fatal

    async def _ship_trigger_logs(self) -> None:
        spec = trigger_logs_spec(self.settings)
        if self.options.create_topics:
            await ensure_topics(self.settings, [spec])
        metrics = self.metrics
        self._log_shipper = TriggerLogShipper(
            producer=self._producer,
            topic=spec.name,
            member=self.member,
            on_drop=metrics.trigger_log_lines_dropped.inc,
            on_sent=metrics.trigger_log_lines.inc,
        )
        self._log_shipper.start()

    async def stop(self) -> None:
        """Stop fetching, release partitions cleanly and leave the groups (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_requested.set()
        started = asyncio.get_running_loop().time()
        for task in self._fetchers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for lane in self._lanes:
            try:
                await lane.release_all()
            except Exception:
                logger.exception("releasing partitions failed", extra={"member": self.member})
        for lane in self._lanes:
            try:
                await lane.close()
            except Exception:
                logger.exception("leaving the group failed", extra={"member": self.member})
        left = asyncio.get_running_loop().time() - started
        if self._supervisor is not None:
            await self._supervisor.stop()
        if self.settings.airflow_services:
            await close_airflow_services()  # its triggers are stopped: nothing asks any more
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self._emitter is not None:
            await self._emitter.stop(self.options.flush_timeout)
        await self._source_offsets.close()  # the acked events' offsets, as far as it can
        if self._log_shipper is not None:  # the triggers are stopped: their last lines
            await self._log_shipper.stop()
        if self._producer is not None:  # stop() flushes; bounded, since the broker may be gone
            await stop_client(self._producer, grace=self.options.flush_timeout, name="producer")
        if self._store is not None:
            self._store.close()
        if self._server is not None:
            await self._server.stop()
        logger.info(
            "triggerer stopped",
            extra={"member": self.member, "left_group_after_s": round(left, 3)},
        )

    async def run(self, *, handle_signals: bool = True) -> None:
        """Run until SIGTERM/SIGINT (or :meth:`request_stop`); raise if something was fatal."""
        await run_until_signal(self, signals=STOP_SIGNALS if handle_signals else ())
        if self._fatal is not None:
            raise TriggererError(str(self._fatal)) from self._fatal

    # -- callbacks ------------------------------------------------------------------------------

    def _on_outcome(self, outcome: TriggerOutcome) -> None:
        ref = outcome.context
        if isinstance(ref, TriggerRef):
            ref.route.deliver(ref, outcome)
        else:  # pragma: no cover - every trigger is added with a TriggerRef
            logger.error("outcome without a source", extra={"trigger_id": outcome.trigger_id})

    def _on_fatal(self, error: BaseException) -> None:
        if self._fatal is None:
            self._fatal = error
        logger.error("triggerer stopping: %s", error, extra={"member": self.member})
        self._stop_requested.set()

    def _fetcher_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self._on_fatal(error)

    def _stop_trigger(self, trigger_id: str, *, kill: bool = False) -> None:
        self._cancels.put_nowait((trigger_id, kill))

    async def _reap(self) -> None:
        """Cancel triggers that emitted, were cancelled or tombstoned elsewhere (with cleanup;
        after ``on_kill()`` for those a user cancelled)."""
        supervisor = self.supervisor
        while True:
            batch = [await self._cancels.get()]
            while not self._cancels.empty() and len(batch) < 1000:
                batch.append(self._cancels.get_nowait())
            await asyncio.gather(*(supervisor.cancel(tid, kill=kill) for tid, kill in batch))


# -- CLI ---------------------------------------------------------------------------------------


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (value or "").split(",") if part.strip())


@click.command(name="triggerer")
@click.option(
    "--capacity",
    type=click.IntRange(min=1),
    default=DEFAULT_CAPACITY,
    show_default=True,
    help="Triggers run at once by this process; more wait for capacity.",
)
@click.option(
    "--queues",
    default=None,
    metavar="A,B",
    help="Trigger queues to serve (comma-separated); default: the default queue only.",
)
@metrics_options
@click.option("--member", default=None, help="Member name in events and logs [hostname-pid].")
@click.option(
    "--static",
    is_flag=True,
    help="Static group membership: --member becomes the group.instance.id, so a restart "
    "within the session timeout gets the same partitions back without a rebalance.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint directory [$XDG_STATE_HOME/deferline/triggerer].",
)
@click.option(
    "--no-checkpoint",
    is_flag=True,
    help="Keep no local checkpoint (every assignment rebuilds from the topics).",
)
@click.option(
    "--direct-resume",
    is_flag=True,
    help="Also enqueue RunTask(mode=resume) for fired triggers carrying `resume`.",
)
@transactions_option(
    "Write each partition's events, copies and tombstones in Kafka transactions (exactly "
    "once for read_committed readers; fences a paused old owner)"
)
@click.option(
    "--max-pending",
    type=click.IntRange(min=1),
    default=None,
    help="Pause fetching above this many waiting triggers + unsent events [10 x capacity].",
)
@click.option(
    "--max-unsent",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="Hold due timers while this many events wait for the producer (bounds burst memory).",
)
@group_timing_options
@click.option(
    "--fetch-max-wait-ms",
    type=click.IntRange(min=0),
    default=None,
    help="Broker-side fetch wait [chosen at start: 500 on Apache Kafka, which answers a "
    "waiting fetch as soon as data arrives; 20 on Tansu, which holds each fetch this long].",
)
@click.option(
    "--checkpoint-interval",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds between checkpoints and commits.",
)
@click.option("--cleanup-timeout", type=click.FloatRange(min=0.1), default=5.0, show_default=True)
@click.option("--create-topics/--no-create-topics", default=True, show_default=True)
@click.option(
    "--trigger-logs/--no-trigger-logs",
    envvar="DEFERLINE_TRIGGER_LOGS",
    default=False,
    show_default=True,
    help="Ship each trigger's own log lines to <prefix>trigger.logs, for the Airflow bridge "
    "to show in Airflow's UI.",
)
@connection_options
@outage_option
@logging_options
def triggerer_command(
    settings: Settings,
    capacity: int,
    queues: str | None,
    metrics_port: int | None,
    metrics_host: str,
    member: str | None,
    static: bool,
    state_dir: Path | None,
    no_checkpoint: bool,
    direct_resume: bool,
    transactions: str,
    max_pending: int | None,
    max_unsent: int,
    session_timeout_ms: int,
    heartbeat_interval_ms: int,
    fetch_max_wait_ms: int | None,
    checkpoint_interval: float,
    cleanup_timeout: float,
    create_topics: bool,
    trigger_logs: bool,
) -> None:
    """Run a triggerer: a consumer-group member that runs the triggers of its partitions."""
    try:
        options = TriggererOptions(
            capacity=capacity,
            queues=_normalise_queues(_split(queues)),
            member=member,
            static=static,
            state_dir=None if no_checkpoint else (state_dir or default_state_dir()),
            direct_resume=direct_resume,
            transactions=TRANSACTIONS[transactions],
            max_pending=max_pending,
            max_unsent=max_unsent,
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
            fetch_max_wait_ms=fetch_max_wait_ms,
            checkpoint_interval=checkpoint_interval,
            cleanup_timeout=cleanup_timeout,
            create_topics=create_topics,
            trigger_logs=trigger_logs,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
        )
    except (ValueError, DeferlineError) as exc:
        raise click.UsageError(str(exc)) from exc
    collect_less_often()
    served = replace(options, metrics_port=None)  # served across restarts instead
    try:
        run_closing(
            ride_out(
                lambda: Triggerer(settings, served),
                settings,
                process="triggerer",
                metrics_port=metrics_port,
                metrics_host=metrics_host,
                registry_of=lambda triggerer: triggerer.metrics.registry,
            )
        )
    except DeferlineError as exc:
        click.echo(f"triggerer failed: {exc}", err=True)
        sys.exit(1)
