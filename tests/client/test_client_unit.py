"""Client pieces that need no broker: task-key parsing and use before start."""

from __future__ import annotations

import datetime as dt

import pytest
from deferline.client import Client, ClientError, parse_ti_key
from deferline.runners.testing import as_json
from deferline.schemas import TaskKey, TaskStateRecord
from deferline.topics import Settings


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("dag/task/run", "dag/task/run/-1"),
        ("dag/task/run/3", "dag/task/run/3"),
        ("dag/task/run/-1", "dag/task/run/-1"),
        ("dag/task/manual__2024-01-01T00:00", "dag/task/manual__2024-01-01T00:00/-1"),
        ("dag/task/run/with/slash/0", "dag/task/run/with/slash/0"),
    ],
)
def test_parse_ti_key(text: str, key: str) -> None:
    assert parse_ti_key(text) == key


@pytest.mark.parametrize("text", ["", "dag", "dag/task", "/task/run", "dag//run", "dag/task/"])
def test_parse_ti_key_rejects(text: str) -> None:
    with pytest.raises(ClientError, match="not a task key"):
        parse_ti_key(text)


async def test_writing_before_start_is_a_clear_error() -> None:
    client = Client(Settings(), ensure=False)
    with pytest.raises(ClientError, match="not started"):
        await client.submit(
            "deferline.engine.examples.WaitOperator",
            dag_id="d",
            task_id="t",
            run_id="r",
            start_from_trigger=False,
        )
    await client.stop()  # idempotent without a start


def test_tasks_json_shows_xcoms() -> None:
    task = TaskKey(dag_id="d", task_id="t", run_id="r")
    moment = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    record = TaskStateRecord(task=task, state="success", xcoms={"return_value": {"at": moment}})
    data = as_json(record)
    assert data["xcoms"] == {
        "return_value": {"at": {"__type": "datetime", "__var": moment.isoformat()}}
    }
    assert data["ti_key"] == task.ti_key
