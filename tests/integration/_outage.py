"""The lost-cluster scenario shared by tests/integration/test_cluster_outage.py (which
asserts its counts) and bench/bench_cluster_outage.py (which reports its times).

One single-node Apache Kafka on its own data; a triggerer, a scheduler, a worker and a
console as processes, as an operator runs them; ``n`` tasks deferred on timers falling due
over ``window`` seconds. At 40 % of the window the only broker is SIGKILLed (``"kill"``) or
SIGSTOPped (``"stop"``), and ``outage`` seconds later started again on its data (or
SIGCONTed). Nobody touches the processes, unless they exit past ``--outage-limit``: then
they are started again once the broker is back (``restart_exited``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import signal
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp
from deferline.schemas import ResumeTarget, RunTask, encode
from deferline.topics import (
    KRaftBroker,
    Settings,
    TansuBroker,
    TopicNames,
    ensure_topics,
    topic_specs,
)

from tests._until import until
from tests.integration._failover import TopicWatch, deferral, publish
from tests.integration._process import DeferlineProcess
from tests.integration._scheduler_help import SchedulerProcess
from tests.integration._triggerer_help import TriggererProcess

# What the worker runs on each resume: a sensor's execute_complete, which succeeds.
RESUME = ResumeTarget(
    operator="deferline.engine.examples.DateTimeSensor",
    op_kwargs={"target_time": "2026-01-01T00:00:00+00:00"},
)
LOST = "lost the Kafka cluster"
BACK = "has the Kafka cluster back after"
TOO_LONG = "outage limit"


@dataclass
class OutageResult:
    """What one run saw."""

    n: int
    how: str
    down_s: float = 0.0
    """From the cluster going to a broker answering again (control run: to the last due)."""
    resumed_tasks: int = 0
    duplicate_resumes: int = 0
    back_to_last_resume_s: float = 0.0
    """From the broker answering again to the last task's first resume RunTask."""
    cpu_while_down_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds each process spent while no broker answered."""
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    """Each first process's exit code (None: still running) when the broker came back."""
    logs: dict[str, list[str]] = field(default_factory=dict)
    """Each first process's outage lines (lost, back, limit)."""
    exited_with: dict[str, str] = field(default_factory=dict)
    """The last lines of a process that exited."""
    while_away: dict[str, str] = field(default_factory=dict)
    """Half-way through the outage: the triggerer's ``/readyz`` status and body, and its
    ``deferline_broker_available`` sample."""
    exited_after_s: float = 0.0
    """With ``restart_exited``: from the cluster going to every first process gone."""


def _cpu_seconds(pid: int) -> float:
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


async def _endpoints(triggerer: TriggererProcess) -> dict[str, str]:
    port = int(triggerer.find("metrics served")[0]["port"])
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/readyz") as response:
            ready = f"{response.status} {await response.text()}"
        async with session.get(f"{base}/metrics?name[]=deferline_broker_available") as response:
            available = await response.text()
    return {"readyz": ready, "metrics": available}


class _Processes:
    """The four processes of one run, started and stopped together."""

    def __init__(self, settings: Settings, workdir: Path, limit: float, generation: int) -> None:
        limit_args = ("--outage-limit", str(limit))
        tag = f"g{generation}"
        self.scheduler = SchedulerProcess(settings, f"scheduler-{tag}", workdir, *limit_args)
        self.triggerer = TriggererProcess(
            settings, f"triggerer-{tag}", workdir, "--capacity", "100000", *limit_args
        )
        log = "--log-format", "json"
        self.worker = DeferlineProcess(
            settings, "worker", workdir / f"worker-{tag}.log", *log, *limit_args
        )
        self.console = DeferlineProcess(
            settings,
            "console",
            workdir / f"console-{tag}.log",
            "--port",
            "0",
            *log,
            *limit_args,
        )

    @property
    def named(self) -> dict[str, DeferlineProcess]:
        return {
            "scheduler": self.scheduler,
            "triggerer": self.triggerer,
            "worker": self.worker,
            "console": self.console,
        }

    async def ready(self, within: float = 90.0) -> None:
        async def all_ready() -> bool:
            if (
                self.scheduler.find("scheduler ready")
                and await self.triggerer.bootstrapped()
                and self.worker.find("worker started")
                and self.console.find("console served")
            ):
                return True
            exited = {name: p.proc.returncode for name, p in self.named.items() if not p.alive}
            assert not exited, f"processes not ready (exited: {exited})"
            return False

        await until(all_ready, within=within, interval=0.2, what="every process ready")

    def close(self) -> None:
        for process in self.named.values():
            if process.alive:
                process.proc.send_signal(signal.SIGTERM)
        for process in self.named.values():
            with contextlib.suppress(Exception):
                process.proc.wait(30)
            process.close()


async def run_outage(
    workdir: Path,
    *,
    broker: Literal["kafka", "tansu"] = "kafka",
    how: Literal["kill", "stop", "none"] = "kill",
    n: int = 20_000,
    window: float = 20.0,
    outage: float = 30.0,
    limit: float = 300.0,
    restart_exited: bool = False,
    lost_after: float | None = None,
) -> OutageResult:
    """Run the scenario; the broker is stopped before returning.

    ``lost_after``: seconds after the first timer falls due that the cluster goes (default
    40 % of the window; negative: before). ``how="none"``: the same timeline with nothing
    lost, timed from when the last timer falls due (the control run of a benchmark).
    """
    if how == "kill" and broker == "tansu":
        raise ValueError("Tansu keeps its topics in memory: a Tansu started again has none")
    node = KRaftBroker(data_dir=workdir / "kafka") if broker == "kafka" else TansuBroker()
    await node.start()
    settings = Settings(
        bootstrap_servers=node.bootstrap,
        topic_prefix=f"o{uuid.uuid4().hex[:8]}.",
        partitions=6,
        enable_idempotence=broker == "kafka",
    )
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings, worker_queues=["default"]))
    result = OutageResult(n=n, how=how)
    first = _Processes(settings, workdir, limit, 0)
    later: _Processes | None = None
    try:
        async with TopicWatch(settings, names.resumes()) as resumes:
            await first.ready()
            run = uuid.uuid4().hex[:6]
            tasks = [
                (state.model_copy(update={"resume": RESUME}), request)
                for state, request in (
                    deferral(i, run, dt.datetime.fromtimestamp(0, dt.UTC)) for i in range(n)
                )
            ]
            await publish(
                settings, [(names.tasks, s.task.ti_key.encode(), encode(s)) for s, _ in tasks]
            )
            base = time.time() + 5.0 + n / 4000
            requests = []
            for i, (_, template) in enumerate(tasks):
                due = dt.datetime.fromtimestamp(base + window * i / n, dt.UTC)
                request = template.model_copy(update={"kwargs": {"moment": due}})
                requests.append((names.defer(), request.trigger_id.encode(), encode(request)))
            await publish(settings, requests)
            lost_after = 0.4 * window if lost_after is None else lost_after
            await asyncio.sleep(max(0.0, base + lost_after - time.time()))

            pid = node.pid
            assert pid is not None
            cpu_before = {k: _cpu_seconds(p.proc.pid) for k, p in first.named.items()}
            lost_at = time.time()
            if how == "kill":
                os.kill(pid, signal.SIGKILL)
                await node.stop()
            elif how == "stop":
                os.kill(pid, signal.SIGSTOP)
            if restart_exited:  # the cluster stays away until every process has given up
                give_up = lost_at + max(outage, limit + 60.0)
                while any(p.alive for p in first.named.values()) and time.time() < give_up:  # noqa: ASYNC110
                    await asyncio.sleep(0.2)
                result.exited_after_s = round(time.time() - lost_at, 1)
            elif how != "none":  # half-way: what the triggerer's endpoints say
                await asyncio.sleep(max(0.0, lost_at + outage / 2 - time.time()))
                result.while_away = await _endpoints(first.triggerer)
            end = lost_at + outage if how != "none" else base + window
            await asyncio.sleep(max(0.0, end - time.time()))
            result.cpu_while_down_s = {
                k: round(_cpu_seconds(p.proc.pid) - cpu_before[k], 3)
                for k, p in first.named.items()
            }
            if how == "kill":
                await node.start()
            elif how == "stop":
                os.kill(pid, signal.SIGCONT)
            back_at = time.time()
            result.down_s = back_at - lost_at
            result.exit_codes = {k: p.proc.poll() for k, p in first.named.items()}
            if restart_exited:
                later = _Processes(settings, workdir, limit, 1)
                await later.ready()

            def resumed() -> Counter[str]:
                return Counter(v.task.ti_key for _, v in resumes.seen if isinstance(v, RunTask))

            deadline = time.monotonic() + 120 + n / 200
            while len(resumed()) < n:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            last = max((t for t, v in resumes.seen if isinstance(v, RunTask)), default=back_at)
            result.back_to_last_resume_s = max(0.0, last - back_at)
            await asyncio.sleep(3.0)  # a duplicate, if any, would land now
            per_task = resumed()
            result.resumed_tasks = len(per_task)
            result.duplicate_resumes = sum(c - 1 for c in per_task.values())
            for name, process in first.named.items():
                result.logs[name] = [
                    line["message"]
                    for line in process.lines()
                    if any(m in line.get("message", "") for m in (LOST, BACK, TOO_LONG))
                ]
                if not process.alive:
                    tail = process.log_path.read_text(errors="replace").splitlines()[-3:]
                    result.exited_with[name] = "\n".join(tail)
    finally:
        first.close()
        if later is not None:
            later.close()
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(node.pid or -1, signal.SIGCONT)
        await node.stop()
    return result
