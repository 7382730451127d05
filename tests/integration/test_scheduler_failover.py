"""Several ``deferline scheduler`` processes share the task partitions: joins and leaves move
only what they must, a SIGKILLed one's partitions run elsewhere within the session timeout,
(Apache Kafka) a paused one is fenced when it wakes, and through all of it at once (the churn
test) every task is resumed exactly once.

Every task must be resumed exactly once: one resume RunTask and one "queued" state per
deferral, none lost, whatever the processes went through.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from deferline.schemas import encode, utcnow
from deferline.topics import Settings, TopicNames, ensure_topics, topic_specs

from tests._until import until
from tests.integration._failover import deferral, failover_task, publish
from tests.integration._scheduler_help import (
    ACQUIRED,
    SESSION_TIMEOUT,
    TARGET,
    SchedulerProcess,
    all_events_committed,
    flow_caught_up,
    resume_counts,
    shared_out,
)
from tests.integration._taskflow import TaskFlow, task_key
from tests.integration._triggerer_help import TriggererProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

N = 400
RESENT = "RunTask re-sent for a task queued on a re-read event"


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[list[SchedulerProcess]]:
    """Started processes, killed at the end whatever happened."""
    processes: list[SchedulerProcess] = []
    yield processes
    for process in processes:
        process.close()


async def schedulers(
    settings: Settings,
    tmp_path: Path,
    spawn: list[SchedulerProcess],
    *names: str,
    extra: tuple[str, ...] = (),
) -> list[SchedulerProcess]:
    """Start ``names`` one after another, each once the ones before share the partitions;
    ``extra``: more options for each."""
    started = []
    for name in names:
        process = SchedulerProcess(settings, name, tmp_path, *extra)
        spawn.append(process)
        started.append(process)
        await until(
            lambda: shared_out(spawn, settings.partitions),
            within=90,
            interval=0.05,
            what=f"partitions shared out after {name} joined",
        )
    return started


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
    processes: list[SchedulerProcess] | None = None,
) -> None:
    """Each deferral applied once: one "queued" state and one resume RunTask. A scheduler
    that took a partition over without transactions may send a RunTask again (a task still
    queued on an event it re-read, logged): such a copy is the same RunTask, which a worker
    ignores."""
    await until(
        lambda: len({r.task.ti_key for _, r in flow.runs if r.mode == "resume"}) >= len(tasks),
        within=120,
        interval=0.05,
        what="every task resumed",
    )
    # Every event's effects are published once its offset is committed: then count.
    await until(lambda: all_events_committed(settings, flow), within=60, interval=0.05)
    await until(lambda: flow_caught_up(flow), within=30, interval=0.05)
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
    resent = sum(len(p.find(RESENT)) for p in processes or ())
    assert copies <= resent, f"{copies} RunTask copies, {resent} re-sent by a new owner"


@pytest.mark.brokers_differ(
    "generations and join timing differ; on Tansu a takeover re-reads and re-sends"
)
async def test_a_join_takes_a_share_from_the_members_and_a_leave_moves_only_the_leavers(
    settings: Settings, tmp_path: Path, spawn: list[SchedulerProcess]
) -> None:
    a, b = await schedulers(settings, tmp_path, spawn, "a", "b")
    before = {p.name: p.owned for p in (a, b)}
    seen = {p.name: len(p.assignments()) for p in (a, b)}
    assert len(before["a"]) == len(before["b"]) == settings.partitions // 2
    [c] = await schedulers(settings, tmp_path, spawn, "c")
    # A member that keeps all it had may log its assignment after the others: wait for it.
    await until(
        lambda: (
            all(len(p.assignments()) > seen[p.name] for p in (a, b))
            and shared_out(spawn, settings.partitions)
        ),
        within=60,
        interval=0.05,
        what="the join reached every member",
    )
    # The newcomer took about a third, only from the two members, who kept the rest.
    assert len(c.owned) == settings.partitions // 3
    for member in (a, b):
        since = member.assignments()[seen[member.name] :]
        assert since, "the join reached every member"
        assert [p for line in since for p in line["acquired"]] == [], (
            "an existing member acquires nothing at a join"
        )
        assert member.owned <= before[member.name]
        lost = {p for line in since for p in line["lost"]}
        assert lost == before[member.name] - member.owned
    assert c.owned == (before["a"] | before["b"]) - a.owned - b.owned

    ahead = {p.name: p.owned for p in (a, b, c)}
    seen = {p.name: len(p.assignments()) for p in (a, c)}
    b.signal(signal.SIGTERM)  # a clean leave: the member leaves the group at once
    b.proc.wait(30)
    assert b.find("scheduler stopped")
    await until(
        lambda: (
            all(len(p.assignments()) > seen[p.name] for p in (a, c))
            and shared_out(spawn, settings.partitions)
        ),
        within=60,
        interval=0.05,
        what="the leave reached every member",
    )
    for member in (a, c):
        since = member.assignments()[seen[member.name] :]
        assert [p for line in since for p in line["lost"]] == [], (
            "a leave moves only the leaver's partitions"
        )
        assert ahead[member.name] <= member.owned
        acquired = {p for line in since for p in line["acquired"]}
        assert acquired == member.owned - ahead[member.name]
    assert (a.owned - ahead["a"]) | (c.owned - ahead["c"]) == ahead["b"]


@pytest.mark.brokers_differ(
    "without transactions (Tansu) a takeover re-reads its partitions and re-sends"
)
async def test_sigkill_of_a_scheduler_moves_its_partitions_within_the_session_timeout(
    settings: Settings, broker_backend: str, tmp_path: Path, spawn: list[SchedulerProcess]
) -> None:
    tasks = [task_key(f"t{i}") for i in range(N)]
    async with TaskFlow(settings) as flow:
        victim, survivor = await schedulers(settings, tmp_path, spawn, "a", "b")
        orphaned = victim.owned
        for task in tasks:
            await flow.defer(task, resume=TARGET)
        firing = asyncio.create_task(fire_all(flow, tasks, pause=0.05))  # type: ignore[arg-type]
        await flow.wait_for(lambda: len(flow.runs) >= N // 4, within=60)
        victim.signal(signal.SIGKILL)
        killed = time.monotonic()
        victim.proc.wait(10)
        await until(
            lambda: survivor.owned == set(range(settings.partitions)),
            within=60,
            interval=0.02,
            what="the survivor owns every partition",
        )
        moved = time.monotonic() - killed
        # Tansu holds a rebalance's join phase for half the session timeout (see
        # docs/operations.md): there the bound is that much longer.
        bound = SESSION_TIMEOUT * (1.5 if broker_backend == "tansu" else 1.0) + 2.0
        assert moved < bound, f"{moved:.1f}s to run the killed one's partitions"
        print(f"SIGKILL -> partitions written for by the survivor: {moved:.2f}s")
        assert set(survivor.assignments()[-1]["acquired"]) == orphaned
        await firing
        await check_exactly_once(settings, flow, tasks, processes=[survivor])  # type: ignore[arg-type]


@pytest.mark.kafka_only  # Tansu has no transactions: a paused old owner is not fenced there
async def test_a_paused_scheduler_is_fenced_when_it_wakes(
    settings: Settings, tmp_path: Path, spawn: list[SchedulerProcess]
) -> None:
    tasks = [task_key(f"z{i}") for i in range(N)]
    async with TaskFlow(settings) as flow:
        old, new = await schedulers(settings, tmp_path, spawn, "a", "b")
        assert old.find("scheduler writes in transactions")
        for task in tasks:
            await flow.defer(task, resume=TARGET)
        firing = asyncio.create_task(fire_all(flow, tasks, pause=0.05))  # type: ignore[arg-type]
        await flow.wait_for(lambda: len(flow.runs) >= N // 4, within=60)
        old.signal(signal.SIGSTOP)
        await until(lambda: new.owned == set(range(settings.partitions)), within=60, interval=0.05)
        old.signal(signal.SIGCONT)  # wakes believing it owns half, mid-batch perhaps
        await firing
        # The flow reads read_committed: whatever the old owner still sent, fenced, is not seen.
        await check_exactly_once(settings, flow, tasks)  # type: ignore[arg-type]
        # It learns it lost them (a revocation, or a fenced batch), rejoins, and the two
        # share the partitions again.
        await until(lambda: shared_out(spawn, settings.partitions), within=90, interval=0.05)


def _due_deferrals(
    names: TopicNames, run: str, n: int, start: dt.datetime, window: float
) -> list[tuple[str, bytes, bytes]]:
    records = []
    for i in range(n):
        due = start + dt.timedelta(seconds=window * i / n)
        state, request = deferral(i, run, due)
        records.append((names.tasks, state.task.ti_key.encode(), encode(state)))
        records.append((names.defer(), request.trigger_id.encode(), encode(request)))
    return records


# Scaled down for CI; CHURN_TASKS=20000 is the full-scale run (docs/benchmarks.md).
CHURN_TASKS = int(os.environ.get("CHURN_TASKS", "2000"))
CHURN_WINDOW = float(os.environ.get("CHURN_WINDOW", "20"))


@pytest.mark.brokers_differ("exactly once by fencing on Kafka, by re-send and dedup on Tansu")
@pytest.mark.timeout(300 + CHURN_TASKS // 100)
@pytest.mark.parametrize("standby", [False, True], ids=["cold", "standby"])
async def test_churn_every_task_resumed_once_while_schedulers_join_leave_die_and_pause(
    settings: Settings, tmp_path: Path, spawn: list[SchedulerProcess], standby: bool
) -> None:
    """Three schedulers and one triggerer; CHURN_TASKS tasks fall due over CHURN_WINDOW
    seconds. Meanwhile a fourth scheduler joins, one leaves with SIGTERM, one is SIGKILLed,
    one is paused (SIGSTOP) past its session and woken. Every task gets exactly one resume
    RunTask (read committed) and none is left deferred. With ``--standby`` the newcomer
    takes its share from its standby tables."""
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    extra = ("--standby",) if standby else ()
    a, b, c = await schedulers(settings, tmp_path, spawn, "a", "b", "c", extra=extra)
    # Without transactions (Tansu) a paused scheduler is not fenced when it wakes: that step
    # runs only where the broker has them.
    fenced = bool(a.find("scheduler writes in transactions"))
    triggerer = TriggererProcess(settings, "t1", tmp_path)
    try:
        run = uuid.uuid4().hex[:6]
        async with TaskFlow(settings) as flow:
            start = utcnow() + dt.timedelta(seconds=3)
            await publish(settings, _due_deferrals(names, run, CHURN_TASKS, start, CHURN_WINDOW))
            tasks = [failover_task(i, run) for i in range(CHURN_TASKS)]
            keys = {task.ti_key for task in tasks}

            def resumed() -> int:
                return len({r.task.ti_key for _, r in flow.runs if r.mode == "resume"} & keys)

            began = time.monotonic()
            await until(lambda: resumed() >= CHURN_TASKS // 8, within=60, interval=0.05)
            [d] = [SchedulerProcess(settings, "d", tmp_path, *extra)]
            spawn.append(d)  # joins
            await until(lambda: d.owned, within=60, interval=0.05, what="the newcomer owns a share")
            if standby:  # folded before it joined: it took its share over warm
                [joined] = d.find(ACQUIRED)
                assert joined["from_standby"] == sorted(joined["partitions"]), joined
            b.signal(signal.SIGTERM)  # leaves cleanly
            await until(lambda: resumed() >= CHURN_TASKS * 3 // 8, within=60, interval=0.05)
            c.signal(signal.SIGKILL)  # dies
            await until(lambda: resumed() >= CHURN_TASKS // 2, within=60, interval=0.05)
            if fenced:
                a.signal(signal.SIGSTOP)  # pauses past its session...
                await until(
                    lambda: d.owned == set(range(settings.partitions)),
                    within=60,
                    interval=0.05,
                    what="the last member took every partition over",
                )
                a.signal(signal.SIGCONT)  # ...and wakes
            await until(
                lambda: resumed() >= CHURN_TASKS,
                within=CHURN_WINDOW + 120,
                interval=0.05,
                what="every task resumed",
            )
            churned = time.monotonic() - began
            # One "queued" state and one distinct resume RunTask per task (copies only as
            # re-sent by a new owner, identical), read committed.
            await check_exactly_once(settings, flow, tasks, processes=spawn)  # type: ignore[arg-type]
            runs, _ = resume_counts(flow, tasks)
            copies = sum(n - 1 for n in runs.values())
            resent = sum(len(p.find(RESENT)) for p in spawn)
            print(
                f"churn: {CHURN_TASKS} resumed {churned:.1f}s after the first eighth; "
                f"{len(runs)} tasks with a resume RunTask, {copies} copies, {resent} re-sent"
            )
            # The latest state of each task, in one pass (flow.latest per task is quadratic).
            latest = {record.task.ti_key: record.state for record in flow.tasks_log}
            deferred = [key for key in keys if latest.get(key) == "deferred"]
            assert deferred == [], f"{len(deferred)} tasks left deferred"
            assert churned < CHURN_WINDOW + 120
    finally:
        triggerer.close()
