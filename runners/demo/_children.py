"""The demo's child processes: ``deferline`` subprocesses that never outlive the demo."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from deferline.topics import free_port

from ._plan import DemoOptions

__all__ = ["RUN_MARKER_ENV", "Child", "Children", "start_processes"]


RUN_MARKER_ENV = "DEFERLINE_DEMO_RUN"
"""Set in every child's environment: names the processes of one demo run."""


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclasses.dataclass
class Child:
    """A ``deferline`` subprocess, leader of its own process group."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    metrics_port: int | None = None
    killed_at: float | None = None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def _deferline_argv() -> list[str]:
    """How to run the ``deferline`` command: its script beside this Python, else via -c."""
    script = Path(sys.executable).with_name("deferline")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from deferline.runners.cli import main; main()"]


class Children:
    """Starts ``deferline`` subprocesses and makes sure none outlives the demo."""

    def __init__(self, env: Mapping[str, str], logdir: Path) -> None:
        self.env = dict(env)
        self.logdir = logdir
        self.children: dict[str, Child] = {}
        self._logs: list[IO[bytes]] = []

    def spawn(self, name: str, *args: str, metrics_port: int | None = None) -> Child:
        log = self.logdir / f"{name}.log"
        out = open(log, "wb")  # noqa: SIM115 - closed in stop_all
        self._logs.append(out)
        argv = [*_deferline_argv(), *args]
        proc = subprocess.Popen(
            argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        child = Child(name, proc, log, metrics_port)
        self.children[name] = child
        return child

    def sigkill(self, name: str) -> None:
        child = self.children[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.killed_at = time.monotonic()

    async def stop_all(self, grace: float = 8.0) -> None:
        """SIGTERM every process group, SIGKILL what is left after ``grace`` seconds."""
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGTERM)
        for _ in range(max(1, int(grace / 0.05))):
            if not any(c.alive for c in self.children.values()):
                break
            await asyncio.sleep(0.05)
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)
        for _ in range(100):  # reap them (SIGKILL is not ignorable: this is quick)
            if not any(c.alive for c in self.children.values()):
                break
            await asyncio.sleep(0.05)
        for out in self._logs:
            out.close()

    def crashed(self) -> list[Child]:
        return [c for c in self.children.values() if not c.alive and c.killed_at is None]


def start_processes(children: Children, options: DemoOptions) -> None:
    """Two triggerers, a scheduler and a worker, each serving metrics on a local port."""
    for name in ("triggerer-a", "triggerer-b"):
        port = free_port()
        children.spawn(
            name,
            "triggerer",
            *("--member", name, "--metrics-port", str(port), "--metrics-host", "127.0.0.1"),
            *("--no-checkpoint", "--session-timeout-ms", str(options.session_timeout_ms)),
            *("--heartbeat-interval-ms", "500", "--log-level", "WARNING"),
            metrics_port=port,
        )
    for name in ("scheduler", "scheduler-b") if options.kill_scheduler else ("scheduler",):
        port = free_port()
        children.spawn(
            name,
            "scheduler",
            *("--default-pool-slots", "unlimited", "--log-level", "WARNING", "--no-checkpoint"),
            *("--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--session-timeout", "6"),
            metrics_port=port,
        )
    port = free_port()
    children.spawn(
        "worker",
        "worker",
        *("--slots", str(options.slots)),
        *("--metrics-port", str(port), "--metrics-host", "127.0.0.1"),
        metrics_port=port,
    )
