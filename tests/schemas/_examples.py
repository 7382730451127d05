"""One fully populated instance of every record, and the examples of docs/protocol.md."""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from pathlib import Path

from deferline.schemas import (
    AssetRef,
    CancelRequest,
    DeadLetter,
    DeferRequest,
    LogLine,
    PoolGrant,
    PoolWant,
    ResumeTarget,
    RunTask,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    TriggerLogRecord,
    WatchEvent,
    WatchRequest,
    make_event_id,
    make_trigger_id,
    make_watch_event_id,
)
from deferline.schemas.testing import Record

DOCS = Path(__file__).resolve().parents[2] / "docs"
T0 = dt.datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)
PLUS2 = dt.timezone(dt.timedelta(hours=2))

TASK = TaskKey(
    dag_id="etl.daily",
    task_id="wait-for_file",
    run_id="scheduled__2030-01-02",
    map_index=3,
    try_number=2,
)
TRIGGER_ID = make_trigger_id(TASK, 1)
RESUME = ResumeTarget(
    operator="pkg.ops.WaitOperator",
    op_kwargs={"path": "/data/in.csv", "since": T0, "window": dt.timedelta(hours=-1)},
    worker_queue="gpu",
    pool="io",
    pool_slots=2,
    priority_weight=7,
    retries=3,
)
KWARGS = {
    "moment": dt.datetime(2030, 1, 2, 5, tzinfo=PLUS2),
    "amounts": [Decimal("1.10"), Decimal("-0")],
    "ids": {uuid.UUID(int=7)},
    "pair": (1, "a"),
    "raw": b"\x00\xffsecret",
    "at": dt.time(9, 30, tzinfo=PLUS2),
    "day": dt.date(2030, 1, 2),
    "by_number": {1: "one", 2: "two"},
    "__type": "not a tag",
}
PAYLOAD = {"moment": T0, "rows": [1, 2.5, None, "x"]}

RECORDS: list[Record] = [
    DeferRequest(
        trigger_id=TRIGGER_ID,
        task=TASK,
        defer_seq=1,
        classpath="deferline.engine.triggers.DateTimeTrigger",
        kwargs=KWARGS,
        next_method="resume_here",
        next_kwargs={"limit": 5, "since": T0},
        timeout_at=T0 + dt.timedelta(hours=1),
        queue="slow-io",
        end_from_trigger=True,
        requested_at=T0,
        resume=RESUME,
    ),
    CancelRequest(trigger_id=TRIGGER_ID, task=TASK, defer_seq=1, reason="cleared", requested_at=T0),
    TriggerEventRecord(
        event_id=make_event_id(TRIGGER_ID, "fired", PAYLOAD),
        trigger_id=TRIGGER_ID,
        task=TASK,
        defer_seq=1,
        status="fired",
        payload=PAYLOAD,
        task_outcome="success",
        xcoms={"return_value": (1, 2)},
        error=None,
        traceback=None,
        due_at=T0,
        emitted_at=T0 + dt.timedelta(milliseconds=3),
        member="triggerer-1",
        partition=11,
        queue="slow-io",
        resumed_directly=True,
    ),
    TaskStateRecord(
        task=TASK,
        state="deferred",
        trigger_id=TRIGGER_ID,
        defer_seq=1,
        next_method="resume_here",
        next_kwargs={"limit": 5},
        event={"at": T0},
        event_id="e" * 32,
        reason="waiting",
        updated_at=T0,
        source="worker",
        resume=RESUME,
        timeout_at=T0,
        queue="slow-io",
    ),
    RunTask(
        task=TASK,
        mode="resume",
        operator="pkg.ops.WaitOperator",
        op_kwargs={"path": "/data/in.csv"},
        next_method="resume_here",
        next_kwargs={"limit": 5},
        event=PAYLOAD,
        event_id="e" * 32,
        trigger_id=TRIGGER_ID,
        defer_seq=1,
        worker_queue="gpu",
        pool="io",
        pool_slots=2,
        priority_weight=7,
        retries=3,
        enqueued_at=T0,
    ),
    DeadLetter(
        topic="deferline.defer",
        partition=4,
        offset=1234,
        key=TRIGGER_ID.encode(),
        value=b'{"kind": "defer_request", "version": 9}\xff',
        error="schema version 9 is not supported",
        error_type="UnknownSchemaVersion",
        member="triggerer-1",
        failed_at=T0,
        trigger_id=TRIGGER_ID,
        task=TASK,
    ),
    PoolWant(
        pool="io",
        slots=2,
        priority_weight=7,
        scheduled_at=T0,
        try_number=2,
        partition=5,
    ),
    PoolGrant(pool="io", slots=2, try_number=2, partition=5),
    WatchRequest(
        trigger_id="airflow-7-1893553445678901",
        classpath="airflow.providers.standard.triggers.file.FileDeleteTrigger",
        kwargs={"filepath": "/data/inbox/flag", "poke_interval": 5.0},
        queue="slow-io",
        assets=[AssetRef(name="inbox", uri="file:///data/inbox")],
        requested_at=T0,
    ),
    WatchEvent(
        event_id=make_watch_event_id("airflow-7-1893553445678901", "3f2a9c1d0b7e4a65", 2),
        trigger_id="airflow-7-1893553445678901",
        run="3f2a9c1d0b7e4a65",
        seq=2,
        status="fired",
        payload=PAYLOAD,
        emitted_at=T0,
        member="triggerer-1",
        partition=11,
        queue="slow-io",
    ),
    TriggerLogRecord(
        trigger_id="airflow-7-1893553445678901",
        member="triggerer-1",
        lines=[
            LogLine(at=T0, level="info", logger="my.triggers.Poll", message="polled: 3 left"),
            LogLine(at=T0, level="error", logger=None, message="password ***\nTraceback"),
        ],
        dropped=12,
    ),
]


def doc_block(marker: str, language: str) -> str:
    """The fenced block right after the line holding ``<!-- marker -->`` in docs/protocol.md."""
    lines = (DOCS / "protocol.md").read_text("utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if f"<!-- {marker} -->" in line)
    assert lines[start + 1] == f"```{language}", f"no ```{language} block after {marker}"
    end = lines.index("```", start + 2)
    return "\n".join(lines[start + 2 : end])
