"""Riding out a lost Kafka cluster, the same way in every long-lived process.

A broker restart, a node replaced, a network cut: for a while no broker answers, by
refusing connections (the process gone) or by never replying (frozen, partitioned). Each
process (triggerer, scheduler, worker, Airflow bridge, console) runs under :func:`ride_out`:

- a :class:`ClusterWatch` asks the cluster for its brokers every couple of seconds, with a
  timeout, so a frozen cluster is seen as lost as surely as a refusing one; it logs one line
  when the cluster is lost and one when it is back (with how long it was gone), and exposes
  ``deferline_broker_available`` and ``/readyz``;
- a component that fails because the cluster is gone is stopped and started again in place
  once the cluster answers: it resumes from what the topics and its checkpoints hold, as a
  process restarted by an orchestrator does, with the same fencing and deduplication;
- past ``Settings.outage_limit`` (``--outage-limit``, ``DEFERLINE_OUTAGE_LIMIT``) without
  the cluster, the process stops and exits non-zero with :class:`ClusterOutageTooLong`,
  which names the cause and the limit, so an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any, TypeVar

from aiokafka import AIOKafkaClient
from aiokafka.errors import KafkaError, KafkaTimeoutError, KafkaUnavailableError
from aiokafka.protocol.metadata import MetadataRequest
from deferline.schemas import DeferlineError
from deferline.topics import Lifecycle, Settings, access_error
from deferline.topics._clients import connection_kwargs, is_bootstrap_failure, probe_access
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ._metrics import MetricsServer
from ._signals import STOP_SIGNALS, stop_requested

__all__ = ["ClusterOutageTooLong", "ClusterWatch", "is_cluster_loss", "ride_out"]

logger = logging.getLogger(__name__)
_AIOKAFKA_LOG = logging.getLogger("aiokafka")
"""Hushed while the cluster is lost: its clients retry and log each refused connection
(hundreds of lines a second, and the CPU to format them); the watch's two lines say it."""

C = TypeVar("C", bound=Lifecycle)
Probe = Callable[[], Awaitable[None]]
"""Raises when the cluster does not answer; returns when one broker did."""

PROBE_INTERVAL = 2.0
"""Seconds between two questions to the cluster while it answers (half that while lost)."""
PROBE_TIMEOUT = 5.0
"""Seconds one question may take before the cluster counts as lost (a frozen broker)."""
STOP_GRACE = 10.0
"""Seconds a component has to stop once the limit is past, before the process exits anyway."""
EXIT_GRACE = 15.0
"""Seconds after the limit past which the process exits at once, however it is stuck (a
client waiting on a frozen broker as the event loop closes, a thread that does not end)."""


class ClusterOutageTooLong(DeferlineError):
    """No broker of the cluster answered for longer than the outage limit."""


class ClusterWatch:
    """Whether this process has its Kafka cluster, since when it has not, and why.

    Two states, *available* and *lost*: :meth:`lost` and :meth:`back` move between them,
    each move logged once. :meth:`run` asks the cluster (``probe``) in a loop and raises
    :class:`ClusterOutageTooLong` once it has been lost longer than ``limit`` seconds.
    """

    def __init__(
        self,
        *,
        process: str,
        limit: float,
        probe: Probe,
        interval: float = PROBE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.process = process
        self.limit = limit
        self._probe = probe
        self._interval = interval
        self._clock = clock
        self.lost_since: float | None = None
        """Monotonic time the cluster was lost at; None while it is available."""
        self.cause = ""
        """Why the cluster counts as lost (the last failure seen)."""
        self.outages = 0
        self.restarts = 0
        """Components started again in place after failing on the lost cluster."""
        self._back = asyncio.Event()
        self._back.set()
        self._hushed = logging.NOTSET
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_WatchCollector(self))

    @property
    def available(self) -> bool:
        return self.lost_since is None

    def lost_for(self) -> float:
        """Seconds the cluster has been lost (0.0 while available)."""
        return 0.0 if self.lost_since is None else self._clock() - self.lost_since

    def lost(self, cause: str) -> None:
        """The cluster did not answer (``cause`` says how); logged at the first failure."""
        self.cause = cause
        if self.lost_since is not None:
            return
        self.lost_since = self._clock()
        self.outages += 1
        self._back.clear()
        self._hushed = _AIOKAFKA_LOG.level
        _AIOKAFKA_LOG.setLevel(logging.CRITICAL)
        logger.warning(
            "%s lost the Kafka cluster (%s); riding it out for up to %.0f s (--outage-limit)",
            self.process,
            cause,
            self.limit,
            extra={"role": self.process, "outage_limit_s": self.limit},
        )

    def back(self) -> None:
        """A broker answered again."""
        if self.lost_since is None:
            return
        gone = self.lost_for()
        self.lost_since = None
        self._back.set()
        _AIOKAFKA_LOG.setLevel(self._hushed)
        logger.warning(
            "%s has the Kafka cluster back after %.1f s",
            self.process,
            gone,
            extra={"role": self.process, "outage_s": round(gone, 3)},
        )

    def failed_on(self, error: BaseException) -> None:
        """The process's component failed on the lost cluster; it starts again once back."""
        self.lost(describe(error))
        self.restarts += 1
        logger.warning(
            "%s stopped on the lost cluster; it starts again once the cluster answers",
            self.process,
            extra={"role": self.process},
        )

    def release(self) -> None:
        """Give aiokafka its log level back if the watch holds it (the watch is done)."""
        if self.lost_since is not None:
            _AIOKAFKA_LOG.setLevel(self._hushed)

    def unready(self) -> str | None:
        """Why the process is not ready (for ``/readyz``), or None while the cluster answers."""
        if self.lost_since is None:
            return None
        return f"the Kafka cluster is unreachable for {self.lost_for():.0f} s: {self.cause}"

    def overdue(self) -> ClusterOutageTooLong | None:
        """The error to exit with once the cluster has been lost longer than the limit."""
        if self.lost_since is None or self.lost_for() <= self.limit:
            return None
        return ClusterOutageTooLong(
            f"{self.process} had no Kafka cluster for {self.lost_for():.1f} s, longer than "
            f"the outage limit of {self.limit:.0f} s (--outage-limit, DEFERLINE_OUTAGE_LIMIT); "
            f"last error: {self.cause}"
        )

    async def until_back(self) -> None:
        await self._back.wait()

    async def ask(self) -> None:
        """Ask the cluster once and move to what the answer says."""
        try:
            await self._probe()
        except (KafkaError, OSError, TimeoutError) as exc:
            self.lost(describe(exc))
        else:
            self.back()

    async def run(self) -> None:
        """Ask the cluster until cancelled; raises :class:`ClusterOutageTooLong` past the
        limit."""
        while True:
            await self.ask()
            if (error := self.overdue()) is not None:
                raise error
            await asyncio.sleep(self._interval if self.available else self._interval / 2)


class _WatchCollector:
    def __init__(self, watch: ClusterWatch) -> None:
        self._watch = watch

    def describe(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        return list(self.collect())  # the names, for a scrape that asks for some by name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        watch = self._watch
        series: list[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, float]] = [
            (
                GaugeMetricFamily,
                "deferline_broker_available",
                "1 while a broker of the Kafka cluster answers this process, 0 while none does",
                1.0 if watch.available else 0.0,
            ),
            (
                GaugeMetricFamily,
                "deferline_broker_unavailable_seconds",
                "Seconds the Kafka cluster has been unreachable (0 while it answers)",
                watch.lost_for(),
            ),
            (
                GaugeMetricFamily,
                "deferline_broker_outage_limit_seconds",
                "Seconds of outage after which the process exits (--outage-limit)",
                watch.limit,
            ),
            (
                CounterMetricFamily,
                "deferline_broker_outages",
                "Times this process lost the Kafka cluster",
                watch.outages,
            ),
            (
                CounterMetricFamily,
                "deferline_broker_outage_restarts",
                "Times a component was started again in place after failing on a lost cluster",
                watch.restarts,
            ),
        ]
        for family, name, documentation, value in series:
            metric = family(name, documentation, labels=["process"])
            metric.add_metric([watch.process], value)
            yield metric


class MetadataProbe:
    """Asks the cluster for its brokers (a Metadata request naming no topic), trying each
    known broker in turn, within ``timeout`` seconds in all."""

    def __init__(self, settings: Settings, *, timeout: float = PROBE_TIMEOUT) -> None:
        self._settings = settings
        self._timeout = timeout
        self._client: AIOKafkaClient | None = None

    async def __call__(self) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                await self._ask()
        except TimeoutError:
            raise TimeoutError(f"no broker answered within {self._timeout:.0f} s") from None

    async def _ask(self) -> None:
        client = self._client
        if client is None:
            client = AIOKafkaClient(
                **connection_kwargs(self._settings),
                request_timeout_ms=int(self._timeout * 1000),
            )
            try:
                await client.bootstrap()
            except BaseException:
                await client.close()
                raise
            self._client = client
        last: BaseException = KafkaUnavailableError("no broker known")
        for broker in client.cluster.brokers():
            try:
                await client.send(broker.nodeId, MetadataRequest([]))
                return
            except (KafkaError, OSError) as exc:
                last = exc
        raise last

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()


def describe(error: BaseException) -> str:
    name, text = type(error).__name__, str(error)
    return text if text.startswith(name) else f"{name}: {text}" if text else name


def is_cluster_loss(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from, or one error of a group) is a broker
    that did not answer: a connection refused, cut or unreachable, a request timed out, a
    retriable Kafka error. Access refused is not one (see :func:`_access_refused`)."""
    pending = [error]
    for _ in range(50):
        if not pending:
            return False
        current = pending.pop()
        if access_error(current) is not None:
            return False
        if isinstance(current, KafkaError) and (
            current.retriable or isinstance(current, KafkaTimeoutError | KafkaUnavailableError)
        ):
            return True
        if isinstance(current, ConnectionError | TimeoutError | socket.gaierror) or (
            isinstance(current, OSError) and current.errno in _UNREACHABLE
        ):
            return True
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        if current.__cause__ is not None:
            pending.append(current.__cause__)
    return False


_UNREACHABLE = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN})


async def _access_refused(error: BaseException, settings: Settings) -> bool:
    """Whether a failure that looks like a lost cluster is the broker refusing this client's
    credentials or certificate (aiokafka says only "Unable to bootstrap" for both)."""
    if not is_bootstrap_failure(error):
        return False
    return await probe_access(settings, timeout_s=PROBE_TIMEOUT) is not None


async def ride_out(
    build: Callable[[], C],
    settings: Settings,
    *,
    process: str,
    metrics_port: int | None = None,
    metrics_host: str = "0.0.0.0",
    registry_of: Callable[[C], CollectorRegistry | None] = lambda _: None,
    signals: tuple[int, ...] = STOP_SIGNALS,
    watch: ClusterWatch | None = None,
    exit_grace: float | None = EXIT_GRACE,
) -> C:
    """Run the component ``build()`` makes until SIGTERM/SIGINT or until it stops by itself,
    riding out a lost cluster (see the module's docstring). Returns the last component.

    With ``metrics_port``, serves ``/metrics`` (the watch's series and the current
    component's ``registry_of``), ``/healthz`` and ``/readyz`` across restarts in place.
    ``watch``: the default asks ``settings``' cluster, with ``settings.outage_limit``.
    Past the limit the process ends within ``exit_grace`` seconds whatever still runs
    (``os._exit(1)`` after printing the error); None leaves the exit to the caller.
    """
    probe: MetadataProbe | None = None
    if watch is None:
        probe = MetadataProbe(settings)
        watch = ClusterWatch(process=process, limit=settings.outage_limit, probe=probe)
    current: list[C] = []

    def registries() -> list[CollectorRegistry]:
        found = [registry_of(c) for c in current]
        return [watch.registry, *(r for r in found if r is not None)]

    server = (
        MetricsServer(registries, host=metrics_host, port=metrics_port, unready=watch.unready)
        if metrics_port is not None
        else None
    )
    async with contextlib.AsyncExitStack() as stack:
        requested = stack.enter_context(stop_requested(signals))
        if server is not None:
            await server.start()
            stack.push_async_callback(server.stop)
        if probe is not None:
            stack.push_async_callback(probe.close)
        stack.callback(watch.release)
        watching = asyncio.create_task(watch.run(), name=f"{process}-cluster-watch")
        stack.callback(watching.cancel)
        if exit_grace is not None:
            watching.add_done_callback(partial(_exit_when_given_up, exit_grace))
        pause = _Backoff()
        while True:
            component = build()
            current[:] = [component]
            try:
                await _run_once(component, requested, watching)
            except ClusterOutageTooLong:
                raise
            except Exception as exc:
                if not is_cluster_loss(exc) or await _access_refused(exc, settings):
                    raise
                current.clear()  # its series would show a member that is gone
                watch.failed_on(exc)
                if not await _first_of(watch.until_back(), requested, watching):
                    return component
                await _first_of(asyncio.sleep(pause.next()), requested, watching)
                if requested.is_set():
                    return component
                continue
            return component


async def _run_once(
    component: Lifecycle, requested: asyncio.Event, watching: asyncio.Task[None]
) -> None:
    """Start ``component`` and run it until it stops, a stop is requested, or the watch gives
    up on the cluster (then its stop gets :data:`STOP_GRACE` seconds and the watch's error is
    raised)."""
    run = asyncio.create_task(_start_and_wait(component, requested))
    try:
        await asyncio.wait({run, watching}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        run.cancel()
        raise
    if run.done():
        run.result()
        return
    run.cancel()  # the limit is past: stop what can be stopped in the grace, then exit
    await asyncio.wait({run}, timeout=STOP_GRACE)  # a stop stuck on the broker stays behind
    watching.result()


async def _start_and_wait(component: Lifecycle, requested: asyncio.Event) -> None:
    async with component:
        await _first_of(component.wait(), requested, None)


async def _first_of(
    work: Awaitable[None], requested: asyncio.Event, watching: asyncio.Task[None] | None
) -> bool:
    """Await ``work`` unless a stop is requested first (False) or the watch fails first (its
    error is raised); True when ``work`` finished (its error is raised)."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(requested.wait())
    waiting: set[asyncio.Future[Any]] = {task, stopper}
    if watching is not None:
        waiting.add(watching)
    try:
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task in done:
        task.result()
        return True
    if watching is not None and watching in done:
        watching.result()
    return False


def _exit_when_given_up(grace: float, watching: asyncio.Task[None]) -> None:
    """Once the watch has given up, end the process ``grace`` seconds later unless it has
    ended by then."""
    if watching.cancelled() or not isinstance(watching.exception(), ClusterOutageTooLong):
        return
    error = watching.exception()

    def exit_now() -> None:
        sys.stderr.write(f"Error: {error} (exited without a clean stop)\n")
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(grace, exit_now)
    timer.daemon = True
    timer.start()


class _Backoff:
    """Pauses before starting a component again: 1 s, doubling to 30 s while restarts
    follow each other within a minute; back to 1 s after a minute without one."""

    def __init__(self) -> None:
        self._pause = 0.5
        self._last = float("-inf")

    def next(self) -> float:
        now = time.monotonic()
        self._pause = 1.0 if now - self._last > 60.0 else min(self._pause * 2, 30.0)
        self._last = now
        return self._pause
