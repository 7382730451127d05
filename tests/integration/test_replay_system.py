"""Replay reads what the real processes write: scheduler, worker and triggerer in this process."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator

import pytest
from deferline.client import Client
from deferline.replay import ReplaySession, Verdict, VerdictKind, parse_subject
from deferline.runners.scheduler import Scheduler
from deferline.runners.triggerer import Triggerer, TriggererOptions
from deferline.runners.worker import Worker
from deferline.schemas import TaskKey
from deferline.topics import Settings

from tests._until import until
from tests.integration import _e2e_ops
from tests.integration._taskflow import TaskFlow

pytestmark = pytest.mark.integration

EXAMPLES = "deferline.engine.examples"


def allowed(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "allowed_trigger_prefixes": ["deferline.engine.triggers", _e2e_ops.MODULE],
            "allowed_operator_prefixes": [EXAMPLES, _e2e_ops.MODULE],
        }
    )


@contextlib.asynccontextmanager
async def triggerer(settings: Settings, member: str) -> AsyncIterator[Triggerer]:
    options = TriggererOptions(member=member, session_timeout_ms=6000, checkpoint_interval=0.5)
    async with Triggerer(settings, options) as running:
        yield running


async def submit(client: Client, name: str, operator: str, **op_kwargs: object) -> TaskKey:
    return await client.submit(
        operator, dag_id="replay", task_id=name, run_id="run1", op_kwargs=op_kwargs
    )


async def why(settings: Settings, subject: str):
    async with ReplaySession(settings) as session:
        return await session.why(parse_subject(subject))


@pytest.mark.brokers_differ(
    "a live group is tied to its topic by member assignment on Kafka, by committed offsets on Tansu"
)
async def test_a_deferral_without_triggerer_then_with_one(settings: Settings, broker_backend: str):
    settings = allowed(settings)
    async with (
        TaskFlow(settings) as flow,
        Scheduler(settings, orphan_check_interval=0.5, commit_interval=0.2) as scheduler,
        Worker(settings, slots=2, poll_interval=0.02, graceful_timeout=5.0),
        Client(settings) as client,
    ):
        await scheduler.wait_active()
        task = await submit(client, "waits", f"{EXAMPLES}.WaitOperator", seconds=600)
        await flow.wait_state(task, "deferred")

        verdict, timeline = await why(settings, task.ti_key)
        assert verdict.kind is VerdictKind.NO_LIVE_TRIGGERER
        kinds = [e.kind for e in timeline]
        assert kinds.count("defer_request") == 1
        assert kinds.index("run_task") < kinds.index("defer_request")

        async with triggerer(settings, "replay-trig-1"):

            async def running() -> Verdict | None:
                found, _ = await why(settings, task.ti_key)
                return found if found.kind is VerdictKind.RUNNING else None

            verdict = await until(running, within=30, interval=0.05, what="verdict 'running'")
            assert verdict.facts["due_at"] > dt.datetime.now(dt.UTC)
            if broker_backend != "tansu":
                assert verdict.facts["member"] == "replay-trig-1"
            async with ReplaySession(settings) as session:
                stuck = await session.stuck(older_than=dt.timedelta(0))
            assert [r.waiting.ti_key for r in stuck] == [task.ti_key]


async def test_real_failures_and_resumes_are_explained(settings: Settings):
    settings = allowed(settings)
    async with (
        TaskFlow(settings) as flow,
        Scheduler(settings, orphan_check_interval=0.5, commit_interval=0.2) as scheduler,
        Worker(settings, slots=2, poll_interval=0.02, graceful_timeout=5.0),
        triggerer(settings, "replay-trig-2"),
        Client(settings) as client,
    ):
        await scheduler.wait_active()
        quick = await submit(client, "quick", f"{EXAMPLES}.WaitOperator", seconds=0.1)
        boom = await submit(client, "boom", f"{_e2e_ops.MODULE}.ExplodeOperator")
        await flow.wait_state(quick, "success")
        await flow.wait_state(boom, "failed")

    verdict, timeline = await why(settings, boom.ti_key)
    assert verdict.kind is VerdictKind.TRIGGER_FAILED
    assert "kaboom" in verdict.facts["traceback"]
    assert verdict.facts["member"] == "replay-trig-2"
    assert verdict.state == "failed"

    verdict, timeline = await why(settings, quick.ti_key)
    assert verdict.kind is VerdictKind.NOT_DEFERRED
    assert verdict.facts["last_deferral"] == "resumed"
    event = next(e for e in timeline if e.kind == "trigger_event")
    assert (event.owner, event.owner_exact, event.decision) == ("replay-trig-2", True, "applied")
    states = [e.description.split()[1] for e in timeline if e.kind == "task_state"]
    assert states[0] == "scheduled"
    assert states[-1] == "success"
    assert "deferred" in states
