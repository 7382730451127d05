"""Riding out a lost cluster: the watch's states, lines and series, and ``ride_out``'s
restarts in place and its exit past the limit, with a scripted probe and components."""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Iterator

import aiohttp
import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    RequestTimedOutError,
    TopicAuthorizationFailedError,
)
from deferline.runners.testing import (
    ClusterOutageTooLong,
    ClusterWatch,
    MetricsServer,
    is_cluster_loss,
    ride_out,
)
from deferline.schemas import DeferlineError
from deferline.topics import Lifecycle, Settings


class Cluster:
    """A probe whose answer the test sets."""

    def __init__(self) -> None:
        self.up = True
        self.asked = asyncio.Event()

    async def __call__(self) -> None:
        self.asked.set()
        if not self.up:
            raise KafkaConnectionError("Connect call failed")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch_of(cluster: Cluster, *, limit: float = 300.0, clock: Clock | None = None) -> ClusterWatch:
    return ClusterWatch(
        process="triggerer", limit=limit, probe=cluster, interval=0.01, clock=clock or Clock()
    )


def samples(watch: ClusterWatch) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in watch.registry.collect()
        for sample in family.samples
    }


async def test_the_watch_says_once_when_the_cluster_is_lost_and_once_when_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster, clock = Cluster(), Clock()
    watch = watch_of(cluster, clock=clock)
    caplog.set_level(logging.WARNING, logger="deferline.runners._outage")
    assert watch.unready() is None
    cluster.up = False
    await watch.ask()
    clock.now += 12.0
    await watch.ask()  # still lost: no second line
    assert watch.lost_since is not None
    assert watch.unready() == (
        "the Kafka cluster is unreachable for 12 s: KafkaConnectionError: Connect call failed"
    )
    assert samples(watch)["deferline_broker_available"] == 0.0
    assert samples(watch)["deferline_broker_unavailable_seconds"] == 12.0
    cluster.up = True
    await watch.ask()
    assert watch.available
    assert [r.getMessage() for r in caplog.records] == [
        "triggerer lost the Kafka cluster (KafkaConnectionError: Connect call failed); riding "
        "it out for up to 300 s (--outage-limit)",
        "triggerer has the Kafka cluster back after 12.0 s",
    ]
    assert samples(watch)["deferline_broker_available"] == 1.0
    assert samples(watch)["deferline_broker_outages_total"] == 1.0


async def test_aiokafka_is_hushed_while_the_cluster_is_lost() -> None:
    cluster = Cluster()
    watch = watch_of(cluster)
    aiokafka = logging.getLogger("aiokafka.conn")
    cluster.up = False
    await watch.ask()
    assert not aiokafka.isEnabledFor(logging.ERROR)
    cluster.up = True
    await watch.ask()
    assert aiokafka.isEnabledFor(logging.WARNING)


async def test_the_watch_gives_up_past_the_limit_naming_it_and_the_cause() -> None:
    cluster, clock = Cluster(), Clock()
    watch = watch_of(cluster, limit=30.0, clock=clock)
    cluster.up = False
    await watch.ask()
    clock.now += 30.0
    assert watch.overdue() is None  # at the limit, not past it
    clock.now += 0.5
    error = watch.overdue()
    assert error is not None
    assert "longer than the outage limit of 30 s (--outage-limit, DEFERLINE_OUTAGE_LIMIT)" in str(
        error
    )
    assert "last error: KafkaConnectionError: Connect call failed" in str(error)
    with pytest.raises(ClusterOutageTooLong):
        await watch.run()


def test_a_lost_cluster_is_told_from_other_failures_through_causes_and_groups() -> None:
    wrapped = DeferlineError("scheduler lost the broker")
    wrapped.__cause__ = RequestTimedOutError()
    assert is_cluster_loss(wrapped)
    assert is_cluster_loss(ExceptionGroup("loops", [ValueError(), ConnectionRefusedError()]))
    assert is_cluster_loss(TimeoutError())
    assert not is_cluster_loss(DeferlineError("bad configuration"))
    assert not is_cluster_loss(ValueError("a bug"))
    taken = DeferlineError("cannot serve the console on 127.0.0.1:8780")
    taken.__cause__ = OSError(errno.EADDRINUSE, "Address already in use")
    assert not is_cluster_loss(taken)  # a port of its own, not the cluster
    denied = DeferlineError("cannot start")
    denied.__cause__ = TopicAuthorizationFailedError()
    assert not is_cluster_loss(denied)
    handled = DeferlineError("a bug while handling a timeout")
    handled.__context__ = RequestTimedOutError()  # only what it was raised from counts
    assert not is_cluster_loss(handled)


class Component(Lifecycle):
    """Fails with ``error`` the first ``failures`` times it runs, then stops by itself."""

    runs = 0

    def __init__(self, error: BaseException, failures: int, cluster: Cluster) -> None:
        self._error = error
        self._failures = failures
        self._cluster = cluster
        self.stopped = False

    async def start(self) -> None:
        Component.runs += 1

    async def stop(self) -> None:
        self.stopped = True

    async def wait(self) -> None:
        if Component.runs <= self._failures:
            self._cluster.up = False  # the cluster goes with the failure
            raise self._error
        return


@pytest.fixture(autouse=True)
def _count_runs() -> None:
    Component.runs = 0


@pytest.fixture(autouse=True)
def _aiokafka_level() -> Iterator[None]:
    """A watch left lost holds aiokafka's log level; the next test gets it back."""
    level = logging.getLogger("aiokafka").level
    yield
    logging.getLogger("aiokafka").setLevel(level)


async def test_a_component_failing_on_a_lost_cluster_starts_again_once_it_is_back() -> None:
    cluster = Cluster()
    watch = watch_of(cluster)
    built: list[Component] = []

    def build() -> Component:
        built.append(Component(KafkaConnectionError("gone"), 1, cluster))
        return built[-1]

    async def bring_it_back() -> None:
        await watch_lost.wait()
        cluster.up = True

    watch_lost = asyncio.Event()
    lost = watch.lost

    def lost_and_told(cause: str) -> None:
        lost(cause)
        watch_lost.set()

    watch.lost = lost_and_told  # type: ignore[method-assign]
    back = asyncio.create_task(bring_it_back())
    last = await asyncio.wait_for(
        ride_out(build, Settings(), process="triggerer", signals=(), watch=watch), 10
    )
    await back
    assert len(built) == 2  # one run failed, one started once the cluster answered
    assert last is built[-1]
    assert built[0].stopped
    assert watch.restarts == 1
    assert watch.available


async def test_a_failure_that_is_not_a_lost_cluster_ends_the_process() -> None:
    cluster = Cluster()
    watch = watch_of(cluster)

    def build() -> Component:
        return Component(DeferlineError("a poisoned state directory"), 1, Cluster())

    with pytest.raises(DeferlineError, match="poisoned"):
        await ride_out(build, Settings(), process="scheduler", signals=(), watch=watch)
    assert Component.runs == 1


class Hangs(Lifecycle):
    """Waits for ever (a client stuck on a frozen broker); stopping takes a moment."""

    def __init__(self) -> None:
        self.stopped = False

    async def start(self) -> None:
        return

    async def stop(self) -> None:
        await asyncio.sleep(0.01)
        self.stopped = True

    async def wait(self) -> None:
        await asyncio.Event().wait()


async def test_past_the_limit_a_hung_component_is_stopped_and_the_process_exits() -> None:
    cluster = Cluster()
    cluster.up = False
    watch = ClusterWatch(process="worker", limit=0.2, probe=cluster, interval=0.01)
    component = Hangs()
    aiokafka = logging.getLogger("aiokafka")
    level = aiokafka.level
    with pytest.raises(ClusterOutageTooLong, match="worker had no Kafka cluster"):
        await asyncio.wait_for(
            ride_out(
                lambda: component,
                Settings(),
                process="worker",
                signals=(),
                watch=watch,
                exit_grace=None,  # the test process itself must live on
            ),
            10,
        )
    assert component.stopped
    assert aiokafka.level == level  # the watch gave its level back on the way out


async def test_readyz_answers_503_with_the_reason_while_unready_and_healthz_stays_ok() -> None:
    cluster = Cluster()
    watch = watch_of(cluster)
    server = MetricsServer(lambda: [watch.registry], host="127.0.0.1", unready=watch.unready)
    await server.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/readyz") as response:
                assert response.status == 200
            cluster.up = False
            await watch.ask()
            async with session.get(f"{base}/readyz") as response:
                assert response.status == 503
                assert "the Kafka cluster is unreachable" in await response.text()
            async with session.get(f"{base}/healthz") as response:
                assert response.status == 200  # alive: restarting it would not help
            async with session.get(f"{base}/metrics") as response:
                assert 'deferline_broker_available{process="triggerer"} 0.0' in (
                    await response.text()
                )
            named = f"{base}/metrics?name[]=deferline_broker_unavailable_seconds"
            async with session.get(named) as response:
                text = await response.text()
                assert "deferline_broker_unavailable_seconds{" in text
                assert "deferline_broker_available{" not in text
    finally:
        await server.stop()
