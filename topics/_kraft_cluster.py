"""Three Apache Kafka nodes on loopback, each both broker and controller (KRaft)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from ._errors import BrokerStartError
from ._kafka_runtime import (
    KAFKA_VERSION,
    _format_storage,
    _jvm,
    _new_cluster_id,
    default_cache_dir,
    fetch_kafka_jars,
)
from ._process import _LIVE, _die_with_parent, _metadata_broker_count, _terminate, free_port

logger = logging.getLogger(__name__)


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


# One node of a three-node cluster: broker and controller in one process. Internal topics
# are replicated three ways with min ISR 2, like the data topics, so losing one node loses
# neither offsets nor transaction state.
# Small index files: see ``_STORAGE_PROPERTIES`` in ``_kraft``.
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
group.min.session.timeout.ms=1000
transaction.abort.timed.out.transaction.cleanup.interval.ms=1000
log.cleaner.backoff.ms=500
log.index.size.max.bytes=262144
num.network.threads=2
num.io.threads=2
num.replica.fetchers=1
background.threads=2
replica.lag.time.max.ms=10000
broker.session.timeout.ms=6000
broker.heartbeat.interval.ms=1000
"""
