"""Each trigger's own log lines: attributed, bounded, masked and batched in the triggerer;
written where Airflow's log reader finds them by the bridge (no broker, no Airflow)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from deferline.engine import BaseTrigger, TriggerEvent, TriggerSupervisor
from deferline.runners.airflow_bridge import bridge_trigger_id
from deferline.runners.airflow_bridge.testing import RowRef, TriggerLogFiles
from deferline.runners.triggerer.testing import TriggerLogCapture, trigger_log_batches
from deferline.schemas import LogLine, TriggerLogRecord

T0 = dt.datetime(2026, 12, 7, tzinfo=dt.UTC)


class Chatty(BaseTrigger):
    def __init__(self, lines: int) -> None:
        super().__init__()
        self.lines = lines

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "tests.Chatty", {"lines": self.lines}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        for number in range(self.lines):
            self.log.info("line %d", number)
        await asyncio.to_thread(self.log.warning, "from a thread")
        logging.getLogger("deferline.runners.x").info("the triggerer's own line")
        yield TriggerEvent(self.lines)


async def run_triggers(capture: TriggerLogCapture, **triggers: BaseTrigger) -> None:
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(capture)
    fired: list[str] = []
    all_fired = asyncio.Event()

    def on_event(outcome: Any) -> None:
        fired.append(outcome.trigger_id)
        if len(fired) == len(triggers):
            all_fired.set()

    try:
        async with TriggerSupervisor(
            capacity=10, on_event=on_event, block_threshold=None
        ) as supervisor:
            for tid, trigger in triggers.items():
                supervisor.add(tid, trigger)
            await asyncio.wait_for(all_fired.wait(), 10)
    finally:
        root.removeHandler(capture)
        root.setLevel(level)


async def test_a_line_belongs_to_the_trigger_that_logged_it_even_from_a_thread() -> None:
    capture = TriggerLogCapture(on_drop=lambda: None)
    logging.getLogger("tests.outside").warning("not a trigger's line")
    await run_triggers(capture, a=Chatty(2), b=Chatty(1))
    lines, dropped = capture.take()
    assert dropped == {}
    by = {tid: [line.message for t, line in lines if t == tid] for tid in ("a", "b")}
    assert by == {"a": ["line 0", "line 1", "from a thread"], "b": ["line 0", "from a thread"]}
    assert {line.level for _, line in lines} == {"info", "warning"}
    assert capture.take() == ([], {})


async def test_past_the_bound_lines_are_dropped_counted_and_said_in_the_next_batch() -> None:
    drops: list[int] = []
    capture = TriggerLogCapture(bound=5, on_drop=lambda: drops.append(1))
    await run_triggers(capture, a=Chatty(8))
    lines, dropped = capture.take()
    assert [line.message for _, line in lines] == [f"line {n}" for n in range(5)]
    assert dropped == {"a": 4}  # three lines and the thread's
    assert len(drops) == 4
    [record] = trigger_log_batches(lines, dropped, "m1")
    assert (record.trigger_id, record.member, record.dropped, len(record.lines)) == (
        "a",
        "m1",
        4,
        5,
    )


def test_a_trigger_that_only_dropped_lines_still_says_so() -> None:
    [record] = trigger_log_batches([], {"a": 3}, "m1")
    assert (record.trigger_id, record.dropped, record.lines) == ("a", 3, [])


def line(message: str, second: int = 0) -> LogLine:
    return LogLine(
        at=T0 + dt.timedelta(seconds=second), level="info", logger="x.T", message=message
    )


def test_the_bridge_writes_the_lines_of_its_rows_as_airflow_writes_a_task_log(
    tmp_path: Path,
) -> None:
    held, other = RowRef.of(7, T0), RowRef.of(8, T0)
    paths = {7: "dag_id=d/run_id=r/task_id=t/attempt=1.log", 8: "elsewhere.log"}
    files = TriggerLogFiles(
        base_folder=str(tmp_path),
        job_id=42,
        task_log_path=paths.get,
        holds=lambda ref: ref == held,
        airflow2=False,
    )
    records = [
        TriggerLogRecord(trigger_id=bridge_trigger_id(held), lines=[line("one", 1)], dropped=2),
        TriggerLogRecord(trigger_id=bridge_trigger_id(other), lines=[line("not mine")]),
        TriggerLogRecord(trigger_id="not-a-bridge-trigger", lines=[line("foreign")]),
        TriggerLogRecord(trigger_id=bridge_trigger_id(held), lines=[line("two", 2)]),
    ]
    assert files.write(records) == 3
    written = tmp_path / "dag_id=d/run_id=r/task_id=t/attempt=1.log.trigger.42.log"
    got = [json.loads(raw) for raw in written.read_text().splitlines()]
    assert [g["event"] for g in got][1:] == ["one", "two"]
    assert "2 log lines of this trigger were dropped" in got[0]["event"]
    assert got[1] == {
        "timestamp": "2026-12-07T00:00:01.000000Z",
        "level": "info",
        "event": "one",
        "logger": "x.T",
    }
    assert not (tmp_path / "elsewhere.log.trigger.42.log").exists()
    assert files.done({7}) == ["dag_id=d/run_id=r/task_id=t/attempt=1.log.trigger.42.log"]
    assert files.done({7}) == []


def test_on_airflow_2_the_lines_take_its_text_format(tmp_path: Path) -> None:
    held = RowRef.of(7, T0)
    files = TriggerLogFiles(
        base_folder=str(tmp_path),
        job_id=1,
        task_log_path=lambda _: "t.log",
        holds=lambda ref: True,
        airflow2=True,
    )
    files.write([TriggerLogRecord(trigger_id=bridge_trigger_id(held), lines=[line("one")])])
    text = (tmp_path / "t.log.trigger.1.log").read_text()
    assert text == "[2026-12-07T00:00:00.000000+0000] {x.T} INFO - one\n"
