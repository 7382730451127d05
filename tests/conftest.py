"""Shared fixtures: real brokers for integration tests, per-test Settings, client factories.

Backends (``DEFERLINE_TEST_BACKENDS``, comma-separated, default ``tansu,kafka``):

- ``tansu``: the embedded Tansu broker; must start, or the tests fail.
- ``kafka``: Apache Kafka (KRaft) run from its jars (fetched once through Maven into
  ``~/.cache/deferline``). If it cannot start, its tests fail in CI (``CI=true``) and are
  skipped elsewhere, with the reason.
- ``testcontainers``: Kafka in Docker via testcontainers; skipped unless a Docker engine answers.

Two more Apache Kafka set-ups, each started once per session and only by the tests that ask:
``secured_kafka`` (one node, SASL_SSL with SCRAM-SHA-512 users, a throw-away CA, the
standard authorizer) and ``kafka_cluster`` (three KRaft nodes, each broker and controller).
Both follow the ``kafka`` backend's policy (skipped unless selected; fail in CI if they cannot
start).

``DEFERLINE_TEST_BOOTSTRAP=host:port`` runs the integration tests once, against that cluster
(treated as Apache Kafka). Each broker starts once per session and is stopped at the end, at
exit, or when pytest gets SIGTERM.

Under pytest-xdist (``-n N``, what ``make test`` runs) the controller starts the Tansu and
Kafka backends once, before the workers, and hands each worker their addresses: tests share
them, kept apart by their topic prefixes. Tests are sent to workers one by one, except groups
that go to one worker whole (``_GroupScheduling``): the tests using the secured broker, and
those using the three-node cluster (that one worker starts it; the tests change ACLs and stop
nodes), and the tests of a module sharing a module-scoped fixture (an Airflow deployment is
started once, not once per worker). Groups are sent first, largest first.

Tests that use ``broker`` (or ``settings``) must be marked ``integration``. Each runs once,
on the broker its markers name (this is the one place that decides which):

- ``brokers_differ("why")``: on every selected backend. The behaviour under test takes a
  different path by broker (transactions and fencing, Tansu's short ListOffsets and its
  time-blind offset lookups, group generations and join timing, log identities, compaction);
  the reason says which. ``pytest --collect-only -q -m brokers_differ`` lists them.
- ``tansu_first``: on Tansu when it is selected, else on the first backend. For tests that
  join no consumer group (client, topics, replay over written histories, CLIs): Tansu answers
  them fastest, and they behave the same everywhere.
- ``kafka_only``: on the Apache Kafka backends only (a feature Tansu lacks).
- unmarked: on Apache Kafka when it is selected, else on the first backend: the production
  broker, and the faster one wherever a group is joined (Tansu holds every JoinGroup for half
  the session timeout). ``DEFERLINE_TEST_BACKENDS=tansu`` runs these on Tansu.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import pytest
from deferline.topics import (
    ROLES,
    BrokerError,
    BrokerSecurity,
    KRaftBroker,
    KRaftCluster,
    Settings,
    TansuBroker,
)
from deferline.topics.testing import terminate_all

from tests.airflow_line import airflow_line
from tests.integration._util import KafkaClients

BACKENDS_ENV = "DEFERLINE_TEST_BACKENDS"
BOOTSTRAP_ENV = "DEFERLINE_TEST_BOOTSTRAP"
KNOWN_BACKENDS = ("tansu", "kafka", "testcontainers")
REAL_KAFKA = frozenset({"kafka", "testcontainers", "external"})
_NO_REAL_KAFKA = "no-real-kafka"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def selected_backends() -> list[str]:
    if os.environ.get(BOOTSTRAP_ENV):
        return ["external"]
    raw = os.environ.get(BACKENDS_ENV, "tansu,kafka")
    names = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in KNOWN_BACKENDS]
    if unknown or not names:
        raise pytest.UsageError(
            f"{BACKENDS_ENV}={raw!r}: use a comma-separated subset of {', '.join(KNOWN_BACKENDS)}"
        )
    return names


class BrokerPool:
    """Starts each backend at most once per session and remembers why one could not start."""

    def __init__(self) -> None:
        self._running: dict[str, Any] = {}
        self._bootstrap: dict[str, str] = {}
        self._failed: dict[str, str] = {}
        self.startup_seconds: dict[str, float] = {}

    def bootstrap(self, backend: str) -> str:
        if backend not in self._bootstrap and backend not in self._failed:
            try:
                self._bootstrap[backend] = self._start(backend)
            except Exception as exc:
                self._failed[backend] = f"{type(exc).__name__}: {exc}"
        if backend in self._failed:
            unavailable(backend, self._failed[backend])
        return self._bootstrap[backend]

    def start_shared(self, backends: list[str]) -> None:
        """Start ``backends`` now, remembering why one failed (the controller of an xdist run)."""
        for backend in backends:
            if backend not in self._bootstrap and backend not in self._failed:
                try:
                    self._bootstrap[backend] = self._start(backend)
                except Exception as exc:
                    self._failed[backend] = f"{type(exc).__name__}: {exc}"

    def shared(self) -> str:
        """The started backends' addresses and failures, for an xdist worker to adopt."""
        return json.dumps({"bootstrap": self._bootstrap, "failed": self._failed})

    def adopt(self, shared: str) -> None:
        """Use the brokers another process started (and stops): an xdist worker's pool."""
        started = json.loads(shared)
        self._bootstrap.update(started["bootstrap"])
        self._failed.update(started["failed"])

    def _start(self, backend: str) -> str:
        if backend == "external":
            return os.environ[BOOTSTRAP_ENV]
        if backend == "testcontainers":
            return self._start_testcontainers()
        broker: TansuBroker | KRaftBroker = TansuBroker() if backend == "tansu" else KRaftBroker()
        # Started from the main thread, so the kernel kills it if pytest dies (PDEATHSIG).
        asyncio.run(broker.start())
        self._running[backend] = broker
        self.startup_seconds[backend] = broker.startup_seconds or 0.0
        return broker.bootstrap

    def _start_testcontainers(self) -> str:
        reason = docker_unavailable()
        if reason:
            raise BrokerError(reason)
        from testcontainers.community.kafka import KafkaContainer

        container = KafkaContainer().with_kraft()
        container.start()
        self._running["testcontainers"] = container
        return str(container.get_bootstrap_server())

    def close(self) -> None:
        for backend, broker in list(self._running.items()):
            if isinstance(broker, TansuBroker | KRaftBroker):
                asyncio.run(broker.stop())
            else:
                broker.stop()
            del self._running[backend]


# The principals of the secured broker: the admin (a super user), one per role, and one that
# authenticates but has no ACLs at all.
SECURED_USERS = ("admin", *ROLES, "noacl")


class SecuredKafka:
    """A running SASL_SSL broker with the standard authorizer and one SCRAM user per role."""

    def __init__(self, broker: KRaftBroker) -> None:
        self.broker = broker
        assert broker.tls is not None
        self.ca_file = str(broker.tls.ca_file)
        self.bootstrap = broker.bootstrap

    def settings(self, user: str = "admin", *, prefix: str, **overrides: Any) -> Settings:
        """Settings for ``user`` (its real password unless overridden) under ``prefix``."""
        return Settings(
            **self.broker.client_settings(
                user, client_id=f"deferline-test-{user}", topic_prefix=prefix, partitions=2
            ),
            **overrides,
        )

    def flags(self, user: str, *, prefix: str, password: str | None = None) -> list[str]:
        """The CLI connection flags for ``user`` (password from ``password`` or its own)."""
        secret = password if password is not None else f"{user}-secret"
        return [
            "--bootstrap-servers",
            self.bootstrap,
            "--security-protocol",
            "SASL_SSL",
            "--sasl-mechanism",
            "SCRAM-SHA-512",
            "--sasl-username",
            user,
            "--sasl-password",
            secret,
            "--ssl-cafile",
            self.ca_file,
            "--topic-prefix",
            prefix,
        ]


class _ExtraKafka:
    """Starts the secured broker and the cluster lazily, once each, and stops them at the end."""

    def __init__(self) -> None:
        self._started: dict[str, Any] = {}
        self._failed: dict[str, str] = {}

    def get(self, name: str) -> Any:
        if "kafka" not in selected_backends():
            pytest.skip(f"{name}: {BACKENDS_ENV} does not select the kafka backend")
        if name not in self._started and name not in self._failed:
            try:
                self._started[name] = self._start(name)
            except Exception as exc:
                self._failed[name] = f"{type(exc).__name__}: {exc}"
        if name in self._failed:
            unavailable("kafka", f"{name}: {self._failed[name]}")
        return self._started[name]

    def _start(self, name: str) -> Any:
        if name == "secured":
            users = {user: f"{user}-secret" for user in SECURED_USERS}
            broker = KRaftBroker(heap="448m", security=BrokerSecurity(users=users))
            asyncio.run(broker.start())
            _POOL.startup_seconds["kafka-secured"] = broker.startup_seconds or 0.0
            return broker
        cluster = KRaftCluster(heap="448m")
        asyncio.run(cluster.start())
        _POOL.startup_seconds["kafka-cluster"] = cluster.startup_seconds or 0.0
        return cluster

    def close(self) -> None:
        for broker in self._started.values():
            asyncio.run(broker.stop())
        self._started.clear()


_EXTRA = _ExtraKafka()


@pytest.fixture(scope="session")
def secured_kafka() -> SecuredKafka:
    """A SASL_SSL (SCRAM-SHA-512) Apache Kafka with ACLs enforced; users in SECURED_USERS,
    each with password ``<user>-secret``."""
    return SecuredKafka(_EXTRA.get("secured"))


@pytest.fixture(scope="session")
def kafka_cluster() -> KRaftCluster:
    """Three Apache Kafka KRaft nodes (each broker and controller) on loopback."""
    cluster: KRaftCluster = _EXTRA.get("cluster")
    return cluster


def unavailable(backend: str, reason: str) -> None:
    """Fail or skip a test whose backend is unavailable, as the backend's policy says."""
    message = f"{backend} broker unavailable: {reason}"
    if backend in ("tansu", "external") or (backend == "kafka" and in_ci()):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def docker_unavailable() -> str | None:
    """Why testcontainers cannot run here, or None when a Docker engine answers."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    # Probe the socket first: docker-py leaks a socket when the engine is absent.
    try:
        if host.startswith("unix://"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(3)
                sock.connect(host.removeprefix("unix://"))
        else:
            url = urlsplit(host)
            socket.create_connection((url.hostname or "localhost", url.port or 2375), 3).close()
    except OSError as exc:
        return f"no Docker engine answers at {host} ({exc})"
    try:
        import docker  # type: ignore[import-untyped, unused-ignore]

        client = docker.from_env(timeout=3)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:
        return f"the Docker engine at {host} does not answer ({type(exc).__name__}: {exc})"
    return None


_POOL = BrokerPool()
_PREVIOUS_SIGTERM: Any = None


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    terminate_all(grace=5.0)
    signal.signal(signum, _PREVIOUS_SIGTERM or signal.SIG_DFL)
    os.kill(os.getpid(), signum)


# The group of the tests using each broker that one worker starts and the tests change.
_OWN_WORKER = {"secured_kafka": "secured-kafka", "kafka_cluster": "kafka-cluster"}
_SHARED_BROKERS = "deferline_brokers"
_GROUPS = "deferline_groups"


class _Controller:
    """xdist controller plugin: hands each worker the brokers the controller started and
    where to write the test groups, and schedules by those groups."""

    def __init__(self) -> None:
        self.groups = Path(tempfile.mkdtemp(prefix="deferline-xdist-")) / "groups.json"

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[_SHARED_BROKERS] = _POOL.shared()
        node.workerinput[_GROUPS] = str(self.groups)

    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        return _group_scheduling(config, log, self.groups)

    def pytest_unconfigure(self) -> None:
        shutil.rmtree(self.groups.parent, ignore_errors=True)


def _group_scheduling(config: pytest.Config, log: Any, groups: Path) -> Any:
    """xdist's scope scheduling with each test its own scope, but for the groups the first
    worker wrote (``groups``, read once every worker has collected): xdist's own
    ``loadgroup`` cannot mark test ids on pytest 9."""
    from xdist.scheduler import LoadScopeScheduling

    class _GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        _group_of: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._group_of is None:  # none written when the first worker collected nothing
                self._group_of = json.loads(groups.read_text()) if groups.exists() else {}
            return self._group_of.get(nodeid, nodeid)

    return _GroupScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    global _PREVIOUS_SIGTERM
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        _PREVIOUS_SIGTERM = signal.signal(signal.SIGTERM, _on_sigterm)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        _POOL.adopt(workerinput[_SHARED_BROKERS])
    elif getattr(config.option, "dist", "no") != "no":
        if "not integration" not in (config.option.markexpr or ""):
            _POOL.start_shared([b for b in selected_backends() if b in ("tansu", "kafka")])
        config.pluginmanager.register(_Controller(), "deferline-xdist-controller")


def pytest_unconfigure(config: pytest.Config) -> None:
    _EXTRA.close()
    _POOL.close()
    terminate_all()


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"deferline broker backends: {', '.join(selected_backends())}"]
    if "testcontainers" not in selected_backends():
        lines.append(
            f"  testcontainers backend off (add it to {BACKENDS_ENV}; needs a Docker engine)"
        )
    lines.append(f"airflow: {airflow_line() or 'not installed'}.x line")
    return lines


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _POOL.startup_seconds:
        started = ", ".join(f"{b} {s:.2f}s" for b, s in _POOL.startup_seconds.items())
        terminalreporter.write_line(f"deferline brokers started: {started}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("kafka_only") and not item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.integration)


def _group(item: pytest.Item) -> str | None:
    """The group of ``item`` that one worker runs whole (see the module's docstring)."""
    names = getattr(item, "fixturenames", ())
    for fixture, group in _OWN_WORKER.items():
        if fixture in names:
            return group
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info is not None else ()
    if any(defs and defs[-1].scope == "module" for defs in definitions):
        return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before the worker tells the controller it has collected
def pytest_collection_finish(session: pytest.Session) -> None:
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is not None and workerinput["workerid"] == "gw0":
        groups = {item.nodeid: group for item in session.items if (group := _group(item))}
        written = Path(workerinput[_GROUPS])
        partial = written.with_suffix(".partial")
        partial.write_text(json.dumps(groups))
        partial.replace(written)
    # What collection imported stays for the session: keep it out of every later collection.
    gc.collect()
    gc.freeze()


def airflow_missing() -> str | None:
    """Why the Airflow tests cannot run here (no ``airflow`` or ``airflow2`` extra), or None."""
    needed = ["apache-airflow", "apache-airflow-providers-http"]
    if airflow_line() >= 3:
        needed.append("apache-airflow-providers-standard")
    for distribution in needed:
        try:  # read the installed metadata: importing Airflow here would initialise it
            importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return f"{distribution} is not installed (pip install -e '.[airflow]')"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("airflow") and (reason := airflow_missing()):
        message = f"airflow extra missing: {reason}"
        if in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    uses_broker = "broker_backend" in getattr(item, "fixturenames", ())
    if uses_broker and not item.get_closest_marker("integration"):
        pytest.fail(f"{item.nodeid} uses a broker: mark it @pytest.mark.integration", pytrace=False)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "broker_backend" not in metafunc.fixturenames:
        return
    metafunc.parametrize(
        "broker_backend", brokers_for(metafunc.definition), indirect=True, scope="session"
    )


def brokers_for(test: pytest.Item) -> list[str]:
    """The backends ``test`` runs on, by its markers (see the module's docstring)."""
    backends = selected_backends()
    if test.get_closest_marker("kafka_only"):
        return [b for b in backends if b in REAL_KAFKA] or [_NO_REAL_KAFKA]
    if differ := test.get_closest_marker("brokers_differ"):
        if not differ.args:
            raise pytest.UsageError(f"{test.nodeid}: brokers_differ needs the reason")
        return backends
    if test.get_closest_marker("tansu_first") and "tansu" in backends:
        return ["tansu"]
    return [next((b for b in backends if b in REAL_KAFKA), backends[0])]


@pytest.fixture(scope="session")
def broker_backend(request: pytest.FixtureRequest) -> str:
    """The backend this test runs on: tansu, kafka, testcontainers or external."""
    backend: str = request.param
    if backend == _NO_REAL_KAFKA:
        pytest.skip(f"kafka_only: {BACKENDS_ENV} selects no Apache Kafka backend")
    return backend


@pytest.fixture(scope="session")
def broker(broker_backend: str) -> str:
    """Bootstrap address of a running broker of the current backend (started once)."""
    return _POOL.bootstrap(broker_backend)


@pytest.fixture
def settings(broker: str) -> Settings:
    """Settings for this broker with a topic prefix no other test uses, and 4 partitions."""
    return Settings(
        bootstrap_servers=broker,
        client_id="deferline-test",
        topic_prefix=f"t{uuid.uuid4().hex[:12]}.",
        partitions=4,
    )


@pytest.fixture
async def kafka_clients(settings: Settings) -> AsyncIterator[KafkaClients]:
    """Factory of started producers/consumers/admins for ``settings``, all stopped afterwards."""
    clients = KafkaClients(settings)
    try:
        yield clients
    finally:
        await clients.aclose()


@pytest.fixture(autouse=True)
def _collect_garbage_after_integration_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Collect garbage after each integration test (after its event loop closed), so a Kafka
    client or socket it left open is reported (an unraisable ResourceWarning, an error here)
    at the test that leaked it, not at whichever later test the collector happens to run in."""
    yield
    if request.node.get_closest_marker("integration"):
        gc.collect()
