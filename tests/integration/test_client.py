"""The client API and the task CLI on a real broker (no scheduler: what they publish and read)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from aiokafka import TopicPartition
from click.testing import CliRunner
from deferline.client import Client, ClientError, TaskNotFound
from deferline.engine.triggers import DateTimeTrigger
from deferline.runners.cli import main
from deferline.schemas import (
    CancelRequest,
    DeferRequest,
    KwargsCipher,
    ResumeTarget,
    TaskKey,
    decode,
    make_trigger_id,
    open_kwargs,
)
from deferline.topics import Settings, TopicNames, make_consumer, partition_for

from tests._until import until

pytestmark = [pytest.mark.integration, pytest.mark.tansu_first]

MOMENT = dt.datetime(2031, 1, 1, tzinfo=dt.UTC)


async def read_topic(settings: Settings, topic: str) -> list[tuple[int, bytes | None, Any]]:
    """Everything on ``topic`` now, as (partition, key, record)."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        out: list[tuple[int, bytes | None, Any]] = []

        async def caught_up() -> bool:
            for tp, records in (await consumer.getmany(timeout_ms=100)).items():
                out.extend(
                    (tp.partition, r.key, decode(r.value) if r.value is not None else None)
                    for r in records
                )
            return all([await consumer.position(tp) >= ends[tp] for tp in tps])

        await until(caught_up, within=20, interval=0.05, what=f"read {topic} to its end")
        return out
    finally:
        await consumer.stop()


async def test_submit_then_read_state_and_list(settings: Settings) -> None:
    async with Client(settings) as client:
        task = await client.submit(
            "deferline.engine.examples.WaitOperator",
            dag_id="dag",
            task_id="wait",
            run_id="run/1",
            op_kwargs={"seconds": 5, "result": {"a": [1, 2]}},
            pool="p",
            priority_weight=3,
            retries=2,
            queue="gpu",
        )
        other = await client.submit(
            "deferline.engine.examples.FlakyOperator", dag_id="dag", task_id="flaky", run_id="r"
        )
        state = await client.get_state(task)
        assert state is not None
        assert state.state == "scheduled"
        assert state.source == "client"
        assert state.resume == ResumeTarget(
            operator="deferline.engine.examples.WaitOperator",
            op_kwargs={"seconds": 5, "result": {"a": [1, 2]}},
            worker_queue="gpu",
            pool="p",
            priority_weight=3,
            retries=2,
        )
        by_text = await client.get_state("dag/wait/run/1/-1")
        assert by_text == state
        assert await client.get_state(TaskKey(dag_id="dag", task_id="nope", run_id="r")) is None
        listed = await client.list_tasks(state="scheduled")
        assert [r.task.ti_key for r in listed] == sorted([task.ti_key, other.ti_key])
        assert await client.list_tasks(state=["success", "failed"]) == []
    names = TopicNames(settings.topic_prefix)
    tasks = await read_topic(settings, names.tasks)
    assert [(p, k) for p, k, _ in tasks if k == task.ti_key.encode()] == [
        (partition_for(task.ti_key.encode(), settings.partitions), task.ti_key.encode())
    ]


async def test_start_from_trigger_submission_publishes_the_deferral(settings: Settings) -> None:
    async with Client(settings) as client:
        task = await client.submit(
            "deferline.engine.examples.StartFromTriggerWaitOperator",
            dag_id="dag",
            task_id="sft",
            run_id="r",
            op_kwargs={"seconds": 60, "result": 1},
        )
        state = await client.get_state(task)
    assert state is not None
    assert state.state == "deferred"
    assert state.trigger_id == make_trigger_id(task, 0)
    names = TopicNames(settings.topic_prefix)
    requests = [r for _, _, r in await read_topic(settings, names.defer())]
    assert len(requests) == 1
    request = requests[0]
    assert isinstance(request, DeferRequest)
    assert request.classpath == "deferline.engine.triggers.DateTimeTrigger"
    assert request.next_method == "execute_complete"
    assert request.resume is not None
    assert request.resume.operator == "deferline.engine.examples.StartFromTriggerWaitOperator"


async def test_defer_from_another_orchestrator_then_cancel(settings: Settings) -> None:
    key = KwargsCipher.generate_key()
    sealed = settings.model_copy(update={"kwargs_keys": [key]})
    task = TaskKey(dag_id="ext", task_id="job", run_id="r7")
    names = TopicNames(settings.topic_prefix)
    async with Client(sealed) as client:
        request = await client.defer(
            task, DateTimeTrigger(MOMENT), next_kwargs={"x": 1}, timeout=30, queue="ops"
        )
        assert request.trigger_id == make_trigger_id(task, 0)
        state = await client.get_state(task)
        assert state is not None
        assert state.state == "deferred"
        assert state.queue == "ops"
        # by serialized form, without recording a state
        other = TaskKey(dag_id="ext", task_id="job2", run_id="r7")
        await client.defer(
            other,
            ("deferline.engine.triggers.DateTimeTrigger", {"moment": MOMENT}),
            record_state=False,
        )
        assert await client.get_state(other) is None
        cancel = await client.cancel(request.trigger_id, queue="ops", reason="operator said so")
        with pytest.raises(TaskNotFound):
            await client.cancel("no-such-trigger", queue="ops")
        by_task = await client.cancel(task)
    assert by_task.trigger_id == cancel.trigger_id == request.trigger_id
    records = [r for _, _, r in await read_topic(settings, names.defer("ops"))]
    published = [r for r in records if isinstance(r, DeferRequest)]
    assert len(published) == 1
    assert published[0].kwargs == {}
    assert open_kwargs(published[0], KwargsCipher([key])) == {
        "moment": MOMENT,
        "end_from_trigger": False,
    }
    cancels = [r for r in records if isinstance(r, CancelRequest)]
    assert [c.reason for c in cancels] == ["operator said so", "cancelled"]
    assert cancels[0].task == task


async def test_clear_marks_removed_and_bad_keys_fail_clearly(settings: Settings) -> None:
    async with Client(settings) as client:
        task = await client.submit(
            "deferline.engine.examples.WaitOperator",
            dag_id="dag",
            task_id="c",
            run_id="r",
            op_kwargs={"seconds": 1},
        )
        record = await client.clear(task)
        assert record.state == "removed"
        assert record.trigger_id is None
        state = await client.get_state(task)
        assert state is not None
        assert state.state == "removed"
        with pytest.raises(TaskNotFound):
            await client.clear("dag/missing/r")
        with pytest.raises(ClientError, match="not a task key"):
            await client.get_state("just-a-name")
        with pytest.raises(ClientError, match="invalid task"):
            await client.submit("x.Y", dag_id="bad dag", task_id="t", run_id="r")


def _env(settings: Settings) -> dict[str, str]:
    return {
        "DEFERLINE_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "DEFERLINE_TOPIC_PREFIX": settings.topic_prefix,
        "DEFERLINE_PARTITIONS": str(settings.partitions),
    }


def test_cli_submit_tasks_and_clear(settings: Settings) -> None:
    runner = CliRunner()
    env = _env(settings)
    submitted = runner.invoke(
        main,
        [
            "submit",
            "deferline.engine.examples.WaitOperator",
            "--dag-id",
            "cli",
            "--task-id",
            "w",
            "--run-id",
            "r1",
            "--kwargs",
            '{"seconds": 2}',
            "--retries",
            "1",
        ],
        env=env,
    )
    assert submitted.exit_code == 0, submitted.output
    assert submitted.output.strip() == "cli/w/r1/-1"

    listed = runner.invoke(main, ["tasks", "--json", "--state", "scheduled"], env=env)
    assert listed.exit_code == 0, listed.output
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert [(r["ti_key"], r["state"]) for r in rows] == [("cli/w/r1/-1", "scheduled")]
    assert rows[0]["resume"]["retries"] == 1

    table = runner.invoke(main, ["tasks"], env=env)
    assert table.exit_code == 0, table.output
    assert "cli/w/r1/-1" in table.output
    assert "scheduled" in table.output

    cleared = runner.invoke(main, ["clear", "cli/w/r1"], env=env)
    assert cleared.exit_code == 0, cleared.output
    assert "removed" in cleared.output
    after = runner.invoke(main, ["tasks", "--json"], env=env)
    assert json.loads(after.output.splitlines()[0])["state"] == "removed"

    missing = runner.invoke(main, ["clear", "cli/nothing/r1"], env=env)
    assert missing.exit_code == 1
    assert "no task cli/nothing/r1/-1" in missing.output
    bad = runner.invoke(
        main,
        ["submit", "x.Y", "--dag-id", "d", "--task-id", "t", "--kwargs", "[1]"],
        env=env,
    )
    assert bad.exit_code == 2
    assert "JSON object" in bad.output
