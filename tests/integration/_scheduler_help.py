"""Test helper: ``deferline scheduler`` subprocesses and exactly-once checks of their output."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from deferline.schemas import ResumeTarget, TaskKey
from deferline.topics import Settings, make_consumer

from tests.integration._taskflow import TaskFlow
from tests.integration._triggerer_help import DEFERLINE

TARGET = ResumeTarget(operator="pkg.Op")
LEASE_TIMEOUT = "6"  # Apache Kafka's smallest group session timeout by default


class SchedulerProcess:
    """A ``deferline scheduler`` subprocess with JSON logs captured to a file."""

    def __init__(self, settings: Settings, name: str, workdir: Path, *extra: str) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        args = [
            DEFERLINE,
            "scheduler",
            "--bootstrap-servers",
            settings.bootstrap_servers,
            "--topic-prefix",
            settings.topic_prefix,
            "--default-pool-slots",
            "unlimited",
            "--lease-timeout",
            LEASE_TIMEOUT,
            "--orphan-check-interval",
            "0.5",
            "--log-format",
            "json",
            *extra,
        ]
        env = {**os.environ, "DEFERLINE_PARTITIONS": str(settings.partitions)}
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for raw in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(raw))
        return out

    def find(self, message: str) -> list[dict[str, Any]]:
        return [line for line in self.lines() if line.get("message", "").startswith(message)]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def active(self) -> bool:
        """Alive, and its last role line says active."""
        roles = [
            line["message"]
            for line in self.lines()
            if line.get("message", "").startswith(("scheduler active", "scheduler standing by"))
        ]
        return self.alive and bool(roles) and roles[-1].startswith("scheduler active")

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


def the_active(processes: Sequence[SchedulerProcess]) -> SchedulerProcess | None:
    """The one active scheduler once the group has settled (exactly one says so)."""
    live = [p for p in processes if p.alive]
    active = [p for p in live if p.active]
    joined = all(p.find("scheduler active") or p.find("scheduler standing by") for p in live)
    return active[0] if len(active) == 1 and joined else None


async def all_events_committed(settings: Settings, flow: TaskFlow) -> bool:
    """Every resume partition's committed offset (group ``<prefix>scheduler``) is its end:
    everything the events caused is published."""
    consumer = make_consumer(settings, group_id=f"{settings.topic_prefix}scheduler")
    await consumer.start()
    try:
        tps = [TopicPartition(flow.names.resume(), p) for p in range(settings.partitions)]
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            if ((await consumer.committed(tp)) or 0) < ends[tp]:
                return False
        return True
    finally:
        await consumer.stop()


async def flow_caught_up(flow: TaskFlow) -> bool:
    """The test's reader has read every topic up to its current end."""
    consumer = flow._consumer
    tps = sorted(consumer.assignment())
    ends = await consumer.end_offsets(tps)
    return all([await consumer.position(tp) >= ends[tp] for tp in tps])


def resume_counts(flow: TaskFlow, tasks: Sequence[TaskKey]) -> tuple[Counter[str], Counter[str]]:
    """Per task: resume RunTasks sent, and "queued" states the scheduler wrote for deferral 0."""
    keys = {task.ti_key for task in tasks}
    runs = Counter(
        run.task.ti_key for _, run in flow.runs if run.mode == "resume" and run.task.ti_key in keys
    )
    queued = Counter(
        record.task.ti_key
        for record in flow.tasks_log
        if record.state == "queued"
        and record.source == "scheduler"
        and record.defer_seq == 0
        and record.task.ti_key in keys
    )
    return runs, queued
