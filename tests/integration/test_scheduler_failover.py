"""Several ``deferline scheduler`` processes: one active, standbys taking over on SIGKILL,
and (Apache Kafka) a paused old leader fenced when it wakes.

Every task must be resumed exactly once: one resume RunTask and one "queued" state per
deferral, none lost, whatever the processes went through.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from deferline.topics import Settings

from tests.integration._scheduler_help import (
    TARGET,
    SchedulerProcess,
    all_events_committed,
    flow_caught_up,
    resume_counts,
    the_active,
)
from tests.integration._taskflow import TaskFlow, task_key
from tests.integration._util import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

N = 400
RESENT = "RunTask re-sent for a task queued on a re-read event"


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[list[SchedulerProcess]]:
    """Started processes, killed at the end whatever happened."""
    processes: list[SchedulerProcess] = []
    yield processes
    for process in processes:
        process.close()


async def two_schedulers(
    settings: Settings, tmp_path: Path, spawn: list[SchedulerProcess]
) -> SchedulerProcess:
    spawn.append(SchedulerProcess(settings, "a", tmp_path))
    await wait_until(lambda: spawn[0].active, timeout=60)
    spawn.append(SchedulerProcess(settings, "b", tmp_path))
    await wait_until(lambda: spawn[1].find("scheduler ready"), timeout=60)
    active: SchedulerProcess = await wait_until(lambda: the_active(spawn), timeout=60)
    return active


async def fire_all(flow: TaskFlow, tasks: list[object], *, pause: float) -> None:
    for i, task in enumerate(tasks):
        await flow.fire(task)  # type: ignore[arg-type]
        if i % 20 == 19:
            await asyncio.sleep(pause)  # events keep arriving across the failover


async def check_exactly_once(
    settings: Settings,
    flow: TaskFlow,
    tasks: list[object],
    *,
    leader: SchedulerProcess | None = None,
) -> None:
    """Each deferral applied once: one "queued" state and one resume RunTask. A ``leader``
    that took over without transactions may send a RunTask again (a task still queued on an
    event it re-read, logged): such a copy is the same RunTask, which a worker ignores."""
    await wait_until(
        lambda: len({r.task.ti_key for _, r in flow.runs if r.mode == "resume"}) >= len(tasks),
        timeout=90,
    )
    # Every event's effects are published once its offset is committed: then count.
    await wait_until(lambda: all_events_committed(settings, flow), timeout=60)
    await wait_until(lambda: flow_caught_up(flow), timeout=30)
    runs, queued = resume_counts(flow, tasks)  # type: ignore[arg-type]
    assert len(runs) == len(tasks), "every task resumed"
    assert [k for k, n in queued.items() if n != 1] == [], "one 'queued' state per deferral"
    assert len(queued) == len(tasks)
    distinct = Counter(
        (run.task.ti_key, run.model_dump_json()) for _, run in flow.runs if run.mode == "resume"
    )
    assert sorted(Counter(k for k, _ in distinct).values()) == [1] * len(tasks), (
        "one resume RunTask per deferral (copies identical)"
    )
    copies = sum(n - 1 for n in runs.values())
    resent = len(leader.find(RESENT)) if leader is not None else 0
    assert copies <= resent, f"{copies} RunTask copies, {resent} re-sent by a new leader"


async def test_sigkill_of_the_active_scheduler_resumes_every_task_once(
    settings: Settings, tmp_path: Path, spawn: list[SchedulerProcess]
) -> None:
    tasks = [task_key(f"t{i}") for i in range(N)]
    async with TaskFlow(settings) as flow:
        active = await two_schedulers(settings, tmp_path, spawn)
        for task in tasks:
            await flow.defer(task, resume=TARGET)
        firing = asyncio.create_task(fire_all(flow, tasks, pause=0.05))  # type: ignore[arg-type]
        await flow.wait_for(lambda: len(flow.runs) >= N // 4, within=60)
        active.signal(signal.SIGKILL)
        active.proc.wait(10)
        await firing
        survivor = next(p for p in spawn if p is not active)
        await wait_until(lambda: survivor.active, timeout=60)
        await check_exactly_once(settings, flow, tasks, leader=survivor)  # type: ignore[arg-type]
        assert survivor.find("scheduler active")[-1]["takeover_seconds"] < 30


@pytest.mark.kafka_only  # Tansu has no transactions: a paused old leader is not fenced there
async def test_a_paused_old_leader_is_fenced_when_it_wakes(
    settings: Settings, tmp_path: Path, spawn: list[SchedulerProcess]
) -> None:
    tasks = [task_key(f"z{i}") for i in range(N)]
    async with TaskFlow(settings) as flow:
        old = await two_schedulers(settings, tmp_path, spawn)
        assert old.find("scheduler writes in transactions")
        for task in tasks:
            await flow.defer(task, resume=TARGET)
        firing = asyncio.create_task(fire_all(flow, tasks, pause=0.05))  # type: ignore[arg-type]
        await flow.wait_for(lambda: len(flow.runs) >= N // 4, within=60)
        old.signal(signal.SIGSTOP)
        new = next(p for p in spawn if p is not old)
        await wait_until(lambda: new.active, timeout=60)
        old.signal(signal.SIGCONT)  # wakes believing it leads, mid-batch perhaps
        await firing
        await check_exactly_once(settings, flow, tasks)  # type: ignore[arg-type]
        # The old leader learns it lost: it stands by, or exits fenced; it never leads again.
        await wait_until(
            lambda: not old.active or old.find("scheduler failed") or not old.alive, timeout=60
        )
        assert new.active
