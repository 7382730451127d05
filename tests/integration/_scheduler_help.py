"""Test helper: ``deferline scheduler`` subprocesses and exactly-once checks of their output."""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from aiokafka import TopicPartition
from deferline.schemas import ResumeTarget, TaskKey
from deferline.topics import Settings, make_consumer

from tests.integration._process import DeferlineProcess
from tests.integration._taskflow import TaskFlow

TARGET = ResumeTarget(operator="pkg.Op")
LEASE_TIMEOUT = "6"  # Apache Kafka's smallest group session timeout by default


class SchedulerProcess(DeferlineProcess):
    """A ``deferline scheduler`` subprocess with JSON logs captured to a file."""

    def __init__(self, settings: Settings, name: str, workdir: Path, *extra: str) -> None:
        self.name = name
        super().__init__(
            settings,
            "scheduler",
            workdir / f"{name}.log",
            "--default-pool-slots",
            "unlimited",
            "--lease-timeout",
            LEASE_TIMEOUT,
            "--orphan-check-interval",
            "0.5",
            "--log-format",
            "json",
            "--state-dir",  # one per process: schedulers on one host never share one
            str(workdir / f"{name}-state"),
            *extra,
        )

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


def the_active(processes: Sequence[SchedulerProcess]) -> SchedulerProcess | None:
    """The one active scheduler once the group has settled (exactly one says so)."""
    live = [p for p in processes if p.alive]
    active = [p for p in live if p.active]
    joined = all(p.find("scheduler active") or p.find("scheduler standing by") for p in live)
    return active[0] if len(active) == 1 and joined else None


async def all_events_committed(settings: Settings, flow: TaskFlow) -> bool:
    """Every tasks.events partition's committed offset (group ``<prefix>scheduler``) is its end:
    everything the events caused is published."""
    consumer = make_consumer(settings, group_id=f"{settings.topic_prefix}scheduler")
    await consumer.start()
    try:
        tps = [TopicPartition(flow.names.task_events, p) for p in range(settings.partitions)]
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
