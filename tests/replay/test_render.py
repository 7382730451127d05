"""Rendering: text tables, JSON, the self-contained HTML report, and CLI value parsing."""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest
from deferline.replay import (
    ReplayContext,
    ReplayIndex,
    ReportItem,
    StuckReport,
    WaitingTask,
    build_timeline,
    explain,
    parse_subject,
    render_html,
)
from deferline.replay.testing import (
    dump_json,
    parse_duration,
    parse_time,
    render_stuck,
    render_timeline,
    render_verdict,
)
from rich.console import Console

from ._history import History, at, task_key

NOW = at(3600)


def scenario(run: str = "run1"):
    h = History()
    task = task_key(run=run)
    h.submit(task, 0)
    h.start(task, 1)
    request = h.defer(task, 2)
    tb = "Traceback (most recent call last):\nValueError: <bad> & worse"
    h.emit(request, 40, status="failed", error="ValueError: <bad>", traceback=tb, payload={"e": 1})
    index = ReplayIndex()
    for rec in h.records():
        index.add(rec)
    subject = parse_subject(task.ti_key)
    verdict = explain(index, subject, ReplayContext(now=NOW))
    return task, verdict, build_timeline(index, subject)


def text_of(render) -> str:
    console = Console(record=True, width=220)
    render(console)
    return console.export_text()


def test_verdict_text_names_verdict_evidence_positions_and_traceback():
    _, verdict, timeline = scenario()
    text = text_of(lambda c: render_verdict(c, verdict, timeline))
    assert "trigger_failed" in text
    assert "deferline.defer[" in text
    assert "deferline.tasks[" in text
    assert "ValueError: <bad> & worse" in text
    assert "timeline" in text


def test_timeline_text_has_one_row_per_record():
    _, _, timeline = scenario()
    text = text_of(lambda c: render_timeline(c, timeline))
    for entry in timeline:
        assert str(entry.position) in text


def test_stuck_table_and_counts():
    task, verdict, _ = scenario()
    waiting = WaitingTask(task.ti_key, "deferred", verdict.trigger_id or "", at(2))
    report = StuckReport(waiting, verdict, NOW - at(2))
    text = text_of(lambda c: render_stuck(c, [report], older_than="10m"))
    assert task.ti_key in text
    assert "59m" in text
    assert "1 stuck (> 10m): trigger_failed 1" in text
    data = json.loads(dump_json(report.to_json()))
    assert data["verdict"] == "trigger_failed"
    assert data["age_s"] == pytest.approx(3598)
    assert text_of(lambda c: render_stuck(c, [], older_than="10m")).startswith("no task")


def test_html_is_self_contained_and_escaped():
    _, verdict, timeline = scenario(run="<script>alert(1)</script>")
    html = render_html("report <x>", [ReportItem(verdict, timeline, waiting_since=at(2))], now=NOW)
    assert html.startswith("<!DOCTYPE html>")
    assert html.count("<svg") == 1
    assert "<script" not in html
    assert "&lt;script&gt;" in html
    # Nothing is fetched: no links, sources, imports or url() references.
    assert not re.search(r"<link|src=|@import|url\(", html)
    assert re.findall(r"https?://[^\s\"']+", html) == ["http://www.w3.org/2000/svg"]
    assert "waiting since" in html
    assert "ValueError: &lt;bad&gt; &amp; worse" in html
    for entry in timeline:
        assert str(entry.position) in html


def test_html_report_with_nothing_stuck():
    html = render_html("empty", [], now=NOW)
    assert "0 item(s)" in html


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("10m", 600), ("1h30m", 5400), ("2d", 172800), ("500ms", 0.5)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == dt.timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "ten minutes", "10x", "m10", "1h 30m"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_parse_time():
    now = at(0)
    assert parse_time("2h", now=now) == now - dt.timedelta(hours=2)
    assert parse_time("2025-03-01T12:00:00Z", now=now) == dt.datetime(2025, 3, 1, 12, tzinfo=dt.UTC)
    naive = parse_time("2025-03-01T12:00:00", now=now)
    assert naive.tzinfo is dt.UTC
    with pytest.raises(ValueError, match="ISO time"):
        parse_time("yesterday", now=now)
