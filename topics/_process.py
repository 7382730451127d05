"""A broker child process: start, readiness probe, bounded stop, and no orphans.

Every broker started here runs as a child process on loopback, is ``async with``-able (or
``start()``/``stop()``), exposes ``.bootstrap`` once started, and never outlives the Python
process that started it: it is stopped on ``stop()``, at interpreter exit, and killed by the
kernel if the parent dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import logging
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from ._errors import BrokerStartError

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


# Processes started here and not yet stopped, so that exit handlers can reap them.
_LIVE: dict[int, tuple[subprocess.Popen[bytes], Path | None]] = {}


_LOWEST_PICKED = 10_000
_PICKER = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` a moment ago, below the kernel's ephemeral range.

    The kernel hands out ports from ``ip_local_port_range`` to every outgoing connection, so
    one picked there (as ``bind(0)`` does) can be taken by any client's connection before the
    broker binds it; with tests running in parallel that happens. Below that range only
    another picker can take it, and a random pick makes that unlikely.
    """
    low = _ephemeral_low()
    for _ in range(100):
        port = _PICKER.randrange(_LOWEST_PICKED, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        picked: int = sock.getsockname()[1]
        return picked


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768
    return max(low, _LOWEST_PICKED + 1_000)


def _check_port_free(host: str, port: int) -> None:
    # Tansu binds with SO_REUSEPORT and would silently share a port with another broker.
    # SO_REUSEADDR: the connections of a broker killed on this port (TIME_WAIT) do not
    # count, a socket listening on it does.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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

    def __init__(
        self,
        *,
        host: str,
        port: int | None,
        startup_timeout: float,
        data_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.host = host
        self.data_dir = Path(data_dir) if data_dir is not None else None
        """Where the broker works and keeps its data across starts; None: a temporary folder
        removed on stop."""
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
    def pid(self) -> int | None:
        """The broker process's id while it runs (for CPU figures), else None."""
        return None if self._proc is None else self._proc.pid

    @property
    def log_path(self) -> Path | None:
        """Where the broker's own output goes (removed on stop unless ``data_dir`` is set)."""
        return None if self._workdir is None else self._workdir / "broker.log"

    async def start(self) -> None:
        """Start the broker and return once it answers a Metadata request."""
        if self._proc is not None:
            return
        began = time.monotonic()
        if self.data_dir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"deferline-{self.name}-"))
        else:
            self._workdir = self.data_dir
        try:
            self._workdir.mkdir(parents=True, exist_ok=True)
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
            _LIVE[self._proc.pid] = (self._proc, self._temporary_workdir())
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
        """SIGTERM, then SIGKILL after ``grace`` s; remove a temporary work dir. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _LIVE.pop(proc.pid, None)
            await asyncio.to_thread(_terminate, proc, grace)
        if self._log is not None:
            self._log.close()
            self._log = None
        temporary, self._workdir = self._temporary_workdir(), None
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)

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

    def _temporary_workdir(self) -> Path | None:
        return self._workdir if self.data_dir is None else None

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
