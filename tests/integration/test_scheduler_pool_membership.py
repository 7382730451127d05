"""A limited pool stays exact across ``deferline scheduler`` processes while they come and go.

Three schedulers share the task partitions and a pool of POOL_SLOTS slots; POOL_TASKS tasks
in that pool are submitted at once. The test stands in for the workers: a task the scheduler
queued is set running, held for a moment, and set to success. Meanwhile the scheduler that
owns task partition 0 (the pool ledger owner) is SIGKILLed and a fourth joins. Read back from
the tasks topic in the order its records were produced, no more than POOL_SLOTS tasks ever
hold a slot (latest state queued, running or deferred), and every task succeeds.

The churn test puts the same pool through every change at once: a fourth scheduler joins,
one leaves with SIGTERM, the ledger owner is SIGKILLed and (Apache Kafka) the next ledger
owner is paused (SIGSTOP) past its session and woken.
"""

from __future__ import annotations

import asyncio
import functools
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from deferline.engine import HOLDING_STATES
from deferline.schemas import TaskKey, TaskStateRecord, decode
from deferline.topics import Settings, TopicNames, make_consumer, stop_client

from tests._until import until
from tests.integration._scheduler_help import SchedulerProcess, shared_out
from tests.integration._taskflow import TaskFlow, task_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

POOL = "limited"
POOL_SLOTS = 5
POOL_TASKS = 200
HOLD = 0.1  # seconds a stand-in worker keeps a task running
CHURN_HOLD = 0.5  # longer under churn: the pool is still busy when the last change comes


@pytest.fixture
def spawn() -> Iterator[list[SchedulerProcess]]:
    """Started processes, killed at the end whatever happened."""
    processes: list[SchedulerProcess] = []
    yield processes
    for process in processes:
        process.close()


def start(settings: Settings, tmp_path: Path, name: str) -> SchedulerProcess:
    return SchedulerProcess(settings, name, tmp_path, "--pool", f"{POOL}={POOL_SLOTS}")


def grew_or_stopped(flow: TaskFlow, seen: int, stop: asyncio.Event) -> bool:
    return len(flow.tasks_log) > seen or stop.is_set()


async def run_tasks(
    flow: TaskFlow, keys: set[str], stop: asyncio.Event, hold: float = HOLD
) -> None:
    """Stand-in workers until ``stop`` is set: each task queued by a scheduler runs for
    ``hold`` seconds and succeeds (once per task; all at once, however many are queued)."""
    seen = 0
    taken: set[str] = set()
    running: set[asyncio.Task[None]] = set()

    async def work(task: TaskKey) -> None:
        await flow.worker_state(task, "running")
        await asyncio.sleep(hold)  # the task's work, not a synchronisation
        await flow.worker_state(task, "success")

    while not stop.is_set():
        log = flow.tasks_log
        for record in log[seen:]:
            key = record.task.ti_key
            if record.state == "queued" and key in keys and key not in taken:
                taken.add(key)
                job = asyncio.create_task(work(record.task))
                running.add(job)
                job.add_done_callback(running.discard)
        seen = len(log)
        await flow.wait_for(functools.partial(grew_or_stopped, flow, seen, stop), within=3600)
    await asyncio.gather(*running)


async def history(settings: Settings) -> list[TaskStateRecord]:
    """Every task state on the tasks topic (committed), in the order it was produced: by
    record timestamp (one host's clock), then partition and offset."""
    tasks = TopicNames(settings.topic_prefix).tasks
    consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=10)
    await consumer.start()
    try:
        tps = [TopicPartition(tasks, p) for p in range(settings.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        read: list[tuple[int, int, int, TaskStateRecord]] = []
        while any([await consumer.position(tp) < ends[tp] for tp in tps]):
            batches = await consumer.getmany(timeout_ms=200)
            for tp, messages in batches.items():
                for message in messages:
                    if message.value is None:
                        continue
                    record = decode(message.value)
                    if isinstance(record, TaskStateRecord):
                        read.append((message.timestamp, tp.partition, message.offset, record))
        read.sort(key=lambda item: item[:3])
        return [record for *_, record in read]
    finally:
        await stop_client(consumer, grace=5.0, name="history reader")


def most_holding(records: list[TaskStateRecord], keys: set[str]) -> int:
    """The most tasks of ``keys`` whose latest state holds a slot, at any point."""
    latest: dict[str, str] = {}
    holding = most = 0
    for record in records:
        key = record.task.ti_key
        if key not in keys:
            continue
        before = latest.get(key)
        latest[key] = record.state
        holding += (record.state in HOLDING_STATES) - (before in HOLDING_STATES)
        most = max(most, holding)
    return most


async def start_three(settings: Settings, tmp_path: Path, spawn: list[SchedulerProcess]) -> None:
    """Start schedulers a, b and c one by one, each once the partitions are shared out."""
    for name in ("a", "b", "c"):
        spawn.append(start(settings, tmp_path, name))
        await until(
            lambda: shared_out(spawn, settings.partitions),
            within=90,
            interval=0.05,
            what=f"partitions shared out after {name} joined",
        )


async def test_a_pool_stays_exact_while_the_ledger_owner_dies_and_a_scheduler_joins(
    settings: Settings, tmp_path: Path, spawn: list[SchedulerProcess]
) -> None:
    async with TaskFlow(settings) as flow:
        await start_three(settings, tmp_path, spawn)
        tasks = [task_key(f"pooled{i}") for i in range(POOL_TASKS)]
        keys = {task.ti_key for task in tasks}
        stop = asyncio.Event()
        worker = asyncio.create_task(run_tasks(flow, keys, stop))
        try:
            for task in tasks:
                await flow.submit(task, pool=POOL)

            def succeeded() -> int:
                return sum(
                    1
                    for task in tasks
                    if (latest := flow.latest(task)) is not None and latest.state == "success"
                )

            await flow.wait_for(lambda: succeeded() >= POOL_TASKS // 4, within=120)
            [owner] = [p for p in spawn if 0 in p.owned]
            owner.signal(signal.SIGKILL)  # the pool ledger's owner dies
            owner.proc.wait(10)
            await flow.wait_for(lambda: succeeded() >= POOL_TASKS // 2, within=120)
            spawn.append(start(settings, tmp_path, "d"))  # and another joins
            await until(
                lambda: shared_out(spawn, settings.partitions),
                within=90,
                interval=0.05,
                what="partitions shared out after d joined",
            )
            await flow.wait_for(lambda: succeeded() == POOL_TASKS, within=180)
        finally:
            stop.set()  # not a cancel: Python 3.11's wait_for can swallow one
            await asyncio.wait_for(worker, 30)
        assert [p.name for p in spawn if 0 in p.owned and p is not owner], "partition 0 moved"
        most = most_holding(await history(settings), keys)
        assert most <= POOL_SLOTS, f"{most} tasks held a slot of a pool of {POOL_SLOTS}"
        assert most == POOL_SLOTS, "the pool was full at some point: the bound was tested"


def succeeded(flow: TaskFlow, tasks: list[TaskKey]) -> int:
    return sum(
        1
        for task in tasks
        if (latest := flow.latest(task)) is not None and latest.state == "success"
    )


def ledger_owner(spawn: list[SchedulerProcess]) -> SchedulerProcess:
    """The live scheduler that writes for task partition 0 (the pool ledger's owner)."""
    [owner] = [p for p in spawn if p.alive and 0 in p.owned]
    return owner


@pytest.mark.brokers_differ(
    "the ledger is fenced by transactions on Kafka, kept exact by re-send and dedup on Tansu"
)
async def test_a_pool_stays_exact_while_schedulers_join_leave_die_and_pause(
    settings: Settings, tmp_path: Path, spawn: list[SchedulerProcess]
) -> None:
    tasks = [task_key(f"pooled{i}") for i in range(POOL_TASKS)]
    keys = {task.ti_key for task in tasks}
    async with TaskFlow(settings) as flow:
        await start_three(settings, tmp_path, spawn)
        # Without transactions (Tansu) a paused scheduler is not fenced when it wakes: the
        # pause runs only where the broker has them (as in the scheduler churn test).
        fenced = bool(spawn[0].find("scheduler writes in transactions"))
        stop = asyncio.Event()
        worker = asyncio.create_task(run_tasks(flow, keys, stop, hold=CHURN_HOLD))
        steps: list[tuple[str, int]] = []  # each change and how many had succeeded by then
        try:
            for task in tasks:
                await flow.submit(task, pool=POOL)
            done = functools.partial(succeeded, flow, tasks)
            await flow.wait_for(lambda: done() >= POOL_TASKS // 8, within=120)
            spawn.append(start(settings, tmp_path, "d"))  # joins
            steps.append(("join", done()))
            await until(
                lambda: shared_out(spawn, settings.partitions),
                within=90,
                interval=0.05,
                what="partitions shared out after d joined",
            )
            # A clean leave of one that does not hold the ledger: the kill below does.
            leaver = next(p for p in spawn if p.alive and 0 not in p.owned and p.name != "d")
            leaver.signal(signal.SIGTERM)
            steps.append(("leave", done()))
            leaver.proc.wait(30)
            await until(
                lambda: shared_out(spawn, settings.partitions),
                within=90,
                interval=0.05,
                what="partitions shared out after the leave",
            )
            await flow.wait_for(lambda: done() >= POOL_TASKS * 3 // 8, within=120)
            killed = ledger_owner(spawn)
            killed.signal(signal.SIGKILL)  # the pool ledger's owner dies
            steps.append(("kill ledger owner", done()))
            killed.proc.wait(10)
            await until(
                lambda: shared_out(spawn, settings.partitions),
                within=90,
                interval=0.05,
                what="partitions shared out after the kill",
            )
            paused: SchedulerProcess | None = None
            if fenced:
                await flow.wait_for(lambda: done() >= POOL_TASKS // 2, within=120)
                paused = ledger_owner(spawn)  # the new ledger owner pauses past its session
                [other] = [p for p in spawn if p.alive and p is not paused]
                paused.signal(signal.SIGSTOP)
                steps.append(("pause ledger owner", done()))
                await until(
                    lambda: other.owned == set(range(settings.partitions)),
                    within=90,
                    interval=0.05,
                    what="the other member took every partition over",
                )
                paused.signal(signal.SIGCONT)  # ...and wakes, fenced
            await flow.wait_for(lambda: done() == POOL_TASKS, within=180)
            if paused is not None:  # the woken one rejoins and gets a share back
                await until(
                    lambda: shared_out(spawn, settings.partitions),
                    within=90,
                    interval=0.05,
                    what="partitions shared out after the woken one rejoined",
                )
        finally:
            stop.set()  # not a cancel: Python 3.11's wait_for can swallow one
            await asyncio.wait_for(worker, 30)
        print(f"pool churn: succeeded when each change came: {steps}")
        # Every change came while pooled tasks were still waiting for a slot.
        assert [name for name, n in steps if n >= POOL_TASKS - POOL_SLOTS] == [], steps
        assert killed.name not in {p.name for p in spawn if p.alive}
        most = most_holding(await history(settings), keys)
        assert most <= POOL_SLOTS, f"{most} tasks held a slot of a pool of {POOL_SLOTS}"
        assert most == POOL_SLOTS, "the pool was full at some point: the bound was tested"
