"""`deferline replay ...` end to end through the CLI, against a real broker."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from click.testing import CliRunner
from deferline.replay import REDRIVE_HEADER
from deferline.runners.cli import main
from deferline.schemas import DeferRequest, decode
from deferline.topics import Settings, TopicNames, make_consumer, partition_for

from tests.integration.test_replay import NOW, deferred, history, publish

pytestmark = [pytest.mark.integration, pytest.mark.tansu_first]


def invoke(settings: Settings, *args: str) -> tuple[int, str, str]:
    flags = ["--bootstrap-servers", settings.bootstrap_servers]
    flags += ["--topic-prefix", settings.topic_prefix, "--now", NOW.isoformat(), "-q"]
    result = CliRunner().invoke(main, ["replay", *args, *flags])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


async def read_defer(
    settings: Settings, trigger_id: str
) -> list[tuple[int, bytes | None, list[Any]]]:
    """(offset, value, headers) of every record under ``trigger_id`` in the defer topic."""
    topic = TopicNames(settings.topic_prefix).defer()
    tp = TopicPartition(topic, partition_for(trigger_id.encode(), settings.partitions))
    consumer = make_consumer(settings)
    await consumer.start()
    try:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        consumer.seek(tp, 0)
        found = []
        while True:
            batch = await consumer.getmany(tp, timeout_ms=500)
            records = batch.get(tp, [])
            found += [
                (r.offset, r.value, list(r.headers))
                for r in records
                if r.key == trigger_id.encode()
            ]
            if not records and await consumer.position(tp) >= end:
                break
        return found
    finally:
        await consumer.stop()


def test_stuck_table_json_and_html(settings: Settings, tmp_path: Path):
    h = history(settings)
    never, _ = deferred(h, "never", publish=False)
    boom, request = deferred(h, "boom", when=3)
    h.emit(request, 40, status="failed", error="RuntimeError: boom", traceback="tb", payload={})
    asyncio.run(publish(settings, h))

    code, out, _ = invoke(settings, "stuck", "--older-than", "10m", "--offline")
    assert code == 0
    assert never.ti_key in out
    assert boom.ti_key in out
    assert "never_requested" in out
    assert "trigger_failed" in out

    code, out, _ = invoke(settings, "stuck", "--json", "--offline")
    data = json.loads(out)
    assert data["count"] == 2
    assert data["by_verdict"] == {"never_requested": 1, "trigger_failed": 1}
    assert {t["ti_key"] for t in data["tasks"]} == {never.ti_key, boom.ti_key}
    code, out, _ = invoke(settings, "stuck", "--json", "--offline", "--limit", "1")
    data = json.loads(out)
    assert (data["count"], data["shown"]) == (2, 1)
    assert [t["ti_key"] for t in data["tasks"]] == [never.ti_key]  # the oldest

    report = tmp_path / "stuck.html"
    code, _, err = invoke(settings, "stuck", "--offline", "--html", str(report))
    assert code == 0
    html = report.read_text()
    assert html.count("<svg") == 2
    assert "<script" not in html
    assert f"wrote {report}" in err


def test_why_and_timeline_json(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    h.emit(request, 70, member="trig-a")
    asyncio.run(publish(settings, h))

    code, out, _ = invoke(settings, "why", task.ti_key, "--json", "--timeline")
    assert code == 0
    data = json.loads(out)
    assert data["verdict"] == "fired_not_applied"
    assert data["cause"] == "no_scheduler"
    assert data["trigger_id"] == request.trigger_id
    assert [r["kind"] for r in data["timeline"]][-2:] == ["trigger_event", "tombstone"]

    code, out, _ = invoke(settings, "timeline", request.trigger_id, "--json", "--offline")
    records = json.loads(out)["records"]
    event = next(r for r in records if r["kind"] == "trigger_event")
    assert event["owner"] == "trig-a"
    assert event["record"]["trigger_id"] == request.trigger_id
    assert event["partition"] == partition_for(request.trigger_id.encode(), settings.partitions)

    code, out, _ = invoke(settings, "why", task.ti_key, "--offline")
    assert code == 0
    assert "fired_not_applied" in out


def test_bad_subject_and_unknown_prefix_are_clear_errors(settings: Settings):
    code, _, err = invoke(settings, "why", "dag/task")
    assert code == 2
    assert "neither a trigger id nor" in err
    code, _, err = invoke(settings, "stuck")
    assert code == 1
    assert "no deferline topic with prefix" in err


def test_redrive_dry_run_then_publish(settings: Settings):
    h = history(settings)
    task, request = deferred(h)
    # The triggerer finished it without an event (lost): only a re-drive brings it back.
    h.put(h.names.defer(), request.trigger_id, None)
    _, fired = deferred(h, "fired")
    h.emit(fired, 70)
    asyncio.run(publish(settings, h))
    before = asyncio.run(read_defer(settings, request.trigger_id))

    code, out, _ = invoke(
        settings,
        "redrive",
        request.trigger_id,
        fired.trigger_id,
        "--dry-run",
        "--json",
        "--offline",
    )
    assert code == 0
    plans = {p["trigger_id"]: p for p in json.loads(out)["plans"]}
    assert plans[request.trigger_id]["action"] == "publish"
    assert plans[fired.trigger_id]["action"] == "skip"
    assert asyncio.run(read_defer(settings, request.trigger_id)) == before

    code, out, _ = invoke(settings, "redrive", request.trigger_id, fired.trigger_id, "--offline")
    assert code == 0
    assert "re-published 1 of 2" in out
    after = asyncio.run(read_defer(settings, request.trigger_id))
    # The defer topic is compacted: the cleaner may have dropped the request the tombstone
    # superseded by now, so count what lies past the last record seen before.
    [(_, value, headers)] = [r for r in after if r[0] > before[-1][0]]
    assert value is not None
    republished = decode(value)
    assert isinstance(republished, DeferRequest)
    assert republished.trigger_id == request.trigger_id
    assert republished.task == task
    assert [name for name, _ in headers] == [REDRIVE_HEADER]

    code, out, _ = invoke(settings, "why", task.ti_key, "--json", "--offline")
    data = json.loads(out)
    assert data["verdict"] == "waiting"
    assert data["facts"]["redriven"] is True


def test_run_fires_a_due_timer_locally(settings: Settings, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONASYNCIODEBUG", "")  # restored after the test (run sets it)
    asyncio_log = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_log, "level", asyncio_log.level)
    h = history(settings)
    due = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    _, request = deferred(h, kwargs={"moment": due})
    _, elsewhere = deferred(h, "elsewhere", classpath="somewhere.else.Trigger")
    asyncio.run(publish(settings, h))

    code, out, _ = invoke(settings, "run", request.trigger_id, "--timeout", "20s")
    assert code == 0, out
    assert "event    fired" in out

    code, out, _ = invoke(settings, "run", elsewhere.trigger_id)
    assert code == 2
    assert "TriggerNotAllowed" in out

    code, _, err = invoke(settings, "run", "no-such-trigger")
    assert code == 1
    assert "no DeferRequest recorded" in err
