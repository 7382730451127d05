"""Test helper: ``deferline scheduler`` subprocesses and exactly-once checks of their output."""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from deferline.schemas import ResumeTarget, TaskKey
from deferline.topics import Settings, make_consumer

from tests.integration._process import DeferlineProcess
from tests.integration._taskflow import TaskFlow

TARGET = ResumeTarget(operator="pkg.Op")
SESSION_TIMEOUT = 6.0  # Apache Kafka's smallest group session timeout by default


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
            "--session-timeout",
            str(SESSION_TIMEOUT),
            "--orphan-check-interval",
            "0.5",
            "--log-format",
            "json",
            "--state-dir",  # one per process: schedulers on one host never share one
            str(workdir / f"{name}-state"),
            *extra,
        )

    def assignments(self) -> list[dict[str, Any]]:
        """Its "scheduler partitions assigned" lines, oldest first (generation, partitions,
        kept, acquired, lost)."""
        return self.find("scheduler partitions assigned")

    @property
    def owned(self) -> set[int]:
        """The partitions of its last assignment, once every one acquired in it is taken over
        (empty before, and while a takeover runs)."""
        lines = self.lines()
        last = max(
            (i for i, line in enumerate(lines) if line.get("message") == ASSIGNED), default=None
        )
        if last is None or not self.alive:
            return set()
        taken = {
            p
            for line in lines[last + 1 :]
            if line.get("message") == ACQUIRED
            for p in line["partitions"]
        }
        if not set(lines[last]["acquired"]) <= taken:
            return set()
        return set(lines[last]["partitions"])

    @property
    def active(self) -> bool:
        """Alive, and it writes for at least one partition."""
        return bool(self.owned)

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)


ASSIGNED = "scheduler partitions assigned"
ACQUIRED = "scheduler partitions acquired"


def shared_out(processes: Sequence[SchedulerProcess], partitions: int) -> bool:
    """The live processes own every partition between them, each partition once, and every
    live process owns a share (N members: each ``partitions // N`` or one more)."""
    live = [p for p in processes if p.alive]
    owned = [p.owned for p in live]
    if not live or sum(len(o) for o in owned) != partitions:
        return False
    if set().union(*owned) != set(range(partitions)):
        return False
    low = partitions // len(live)
    return all(low <= len(o) <= low + 1 for o in owned)


async def all_events_committed(settings: Settings, flow: TaskFlow) -> bool:
    """Every tasks.events partition's committed offset (group ``<prefix>scheduler``) is past
    its last event: everything the events caused is published. (Not "is its end": a
    partition written in transactions ends with a commit marker, which no consumer is given.)
    """
    consumer = make_consumer(settings, group_id=f"{settings.topic_prefix}scheduler")
    await consumer.start()
    try:
        tps = [TopicPartition(flow.names.task_events, p) for p in range(settings.partitions)]
        last = await last_record_offsets(settings, tps)
        for tp in tps:
            if ((await consumer.committed(tp)) or 0) <= last.get(tp, -1):
                return False
        return True
    finally:
        await consumer.stop()


async def last_record_offsets(
    settings: Settings, tps: list[TopicPartition]
) -> dict[TopicPartition, int]:
    """The offset of each partition's last committed record (absent: none), read
    ``read_committed`` from the beginning to the end."""
    reader = make_consumer(settings, group_id=None)
    await reader.start()
    try:
        reader.assign(tps)
        await reader.seek_to_beginning(*tps)
        ends = await reader.end_offsets(tps)
        last: dict[TopicPartition, int] = {}
        while any([await reader.position(tp) < ends[tp] for tp in tps]):
            for tp, records in (await reader.getmany(timeout_ms=200)).items():
                if records:
                    last[tp] = records[-1].offset
        return last
    finally:
        await reader.stop()


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
