"""The whole loop with the example operators: client → scheduler → worker → triggerer → back."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from deferline.client import Client
from deferline.runners.scheduler import Scheduler
from deferline.runners.triggerer import Triggerer, TriggererOptions
from deferline.runners.worker import Worker
from deferline.schemas import TaskKey, TaskStateRecord
from deferline.topics import Settings

from tests._until import until

pytestmark = pytest.mark.integration

EXAMPLES = "deferline.engine.examples"
FINAL = {"success", "failed", "skipped", "removed"}


@contextlib.asynccontextmanager
async def system(settings: Settings) -> AsyncIterator[Worker]:
    triggerer = Triggerer(
        settings, TriggererOptions(session_timeout_ms=6_000, heartbeat_interval_ms=500)
    )
    scheduler = Scheduler(settings)
    worker = Worker(settings, slots=2, session_timeout_ms=6_000, heartbeat_interval_ms=500)
    async with triggerer, scheduler, worker:
        await scheduler.wait_active()
        yield worker


async def test_example_operators_run_the_whole_loop(settings: Settings) -> None:
    submissions: dict[str, tuple[str, dict[str, Any], int]] = {
        "once": ("WaitOperator", {"seconds": 0.3, "result": "r"}, 0),
        "multi": ("MultiWaitOperator", {"waits": [0.1, 0.1, 0.1]}, 0),
        "timeout": ("WaitOperator", {"seconds": 60, "timeout": 0.3}, 0),
        "end": ("WaitOperator", {"seconds": 0.2, "end_from_trigger": True}, 0),
        "start": ("StartFromTriggerWaitOperator", {"seconds": 0.2}, 0),
        "flaky": ("FlakyOperator", {"fail_tries": 1}, 1),
        "clear": ("WaitOperator", {"seconds": 3600}, 0),
    }
    async with system(settings) as worker, Client(settings) as client:
        keys: dict[str, TaskKey] = {}
        for name, (operator, kwargs, retries) in submissions.items():
            keys[name] = await client.submit(
                f"{EXAMPLES}.{operator}",
                dag_id="loop",
                task_id=name,
                run_id="r1",
                op_kwargs=kwargs,
                retries=retries,
            )

        async def deferred() -> bool:
            state = await client.get_state(keys["clear"])
            return state is not None and state.state == "deferred"

        await until(deferred, within=60, interval=0.05, what="the long wait is deferred")
        await client.clear(keys["clear"])

        async def finished() -> dict[str, TaskStateRecord] | None:
            states = {r.task.task_id: r for r in await client.list_tasks()}
            done = all(s.state in FINAL for s in states.values()) and len(states) == len(keys)
            return states if done else None

        states = await until(finished, within=90, interval=0.2, what="every task finished")

    assert {name: s.state for name, s in states.items()} == {
        "once": "success",
        "multi": "success",
        "timeout": "failed",
        "end": "success",
        "start": "success",
        "flaky": "success",
        "clear": "removed",
    }
    assert "TaskDeferralTimeout" in (states["timeout"].reason or "")
    assert states["flaky"].task.try_number == 2
    assert states["end"].source == "scheduler"  # ended by its trigger: no second worker run
    # Worker runs: once 2, multi 4, timeout 2, end 1, start 1 (resume only), flaky 2, clear 1.
    assert worker.metrics.started + worker.metrics.resumed == 13
    assert worker.metrics.deferred == 1 + 3 + 1 + 1 + 1
    assert worker.metrics.duplicates == 0
