"""A self-contained HTML report: one inline SVG timeline per task, no scripts, no network."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from deferline.schemas import TaskStateRecord, TriggerEventRecord, WatchEvent

from ._timeline import TimelineEntry
from ._topics import TopicRole
from ._verdict import Verdict

__all__ = ["REPORT_CSS", "ReportItem", "render_html", "render_item"]

_LANES = (
    (TopicRole.TASKS, "tasks"),
    (TopicRole.DEFER, "defer"),
    (TopicRole.RESUME, "resume (events)"),
    (TopicRole.WORK, "queue (start)"),
    (TopicRole.RESUMES, "queue (resumes)"),
    (TopicRole.DEAD, "dead letters"),
)
_COLORS = {
    "defer_request": "#2563eb",
    "watch_request": "#0d9488",
    "cancel_request": "#ea580c",
    "tombstone": "#6b7280",
    "run_task": "#7c3aed",
    "dead_letter": "#dc2626",
    "undecodable": "#111827",
    "fired": "#16a34a",
    "failed": "#dc2626",
    "timed_out": "#ea580c",
    "cancelled": "#6b7280",
    "deferred": "#0891b2",
    "queued": "#7c3aed",
    "running": "#16a34a",
    "success": "#15803d",
    "scheduled": "#64748b",
    "removed": "#6b7280",
    "up_for_retry": "#ea580c",
    "skipped": "#a3a3a3",
}
REPORT_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#111827}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 4px;font-family:monospace}
.meta{color:#6b7280}.badge{display:inline-block;padding:1px 8px;border-radius:10px;
background:#fee2e2;color:#991b1b;font-weight:600;font-size:12px}
.badge.ok{background:#dcfce7;color:#166534}.badge.wait{background:#e0f2fe;color:#075985}
table{border-collapse:collapse;margin:6px 0;font-size:12px}
td,th{padding:2px 8px;border-bottom:1px solid #e5e7eb;text-align:left;vertical-align:top}
th{color:#374151}td.mono{font-family:monospace;white-space:nowrap}
pre{background:#f9fafb;padding:8px;overflow:auto;font-size:12px}
svg{background:#fff;border:1px solid #e5e7eb;margin:6px 0}
svg text{font:11px system-ui,sans-serif;fill:#374151}
.summary{margin:4px 0}details{margin:4px 0}
"""
_OK = {"resumed", "not_deferred", "watch"}
_WAIT = {"running", "waiting"}


@dataclass(frozen=True, slots=True)
class ReportItem:
    """One task or trigger in the report."""

    verdict: Verdict
    timeline: Sequence[TimelineEntry]
    waiting_since: dt.datetime | None = None


def _t(value: dt.datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _color(entry: TimelineEntry) -> str:
    record = entry.record.record if entry.record is not None else None
    if isinstance(record, TriggerEventRecord | WatchEvent):
        return _COLORS.get(record.status, "#374151")
    if isinstance(record, TaskStateRecord):
        return _COLORS.get(record.state, "#374151")
    return _COLORS.get(entry.kind, "#374151")


def _svg(item: ReportItem, now: dt.datetime) -> str:
    entries = [e for e in item.timeline if e.at is not None]
    width, left, right, lane_h, top = 960, 120, 20, 26, 10
    lanes = [(role, label) for role, label in _LANES]
    height = top + lane_h * len(lanes) + 34
    times = [e.at for e in entries if e.at is not None]
    if item.waiting_since is not None:
        times.append(item.waiting_since)
    times.append(now)
    t0, t1 = min(times), max(times)
    span = max((t1 - t0).total_seconds(), 1e-3)
    inner = width - left - right

    def x(at: dt.datetime) -> float:
        return left + inner * (at - t0).total_seconds() / span

    row = {role: i for i, (role, _) in enumerate(lanes)}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">'
    ]
    for i, (_, label) in enumerate(lanes):
        y = top + lane_h * i + lane_h / 2
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#e5e7eb"/>'
        )
        parts.append(f'<text x="8" y="{y + 4:.1f}">{escape(label)}</text>')
    if item.waiting_since is not None:
        xs = x(item.waiting_since)
        parts.append(
            f'<rect x="{xs:.1f}" y="{top}" width="{max(x(now) - xs, 1):.1f}" '
            f'height="{lane_h}" fill="#fecaca" opacity="0.6"><title>waiting since '
            f"{escape(_t(item.waiting_since))}</title></rect>"
        )
    axis_y = top + lane_h * len(lanes) + 4
    for n in range(6):
        tick = t0 + dt.timedelta(seconds=span * n / 5)
        tx = x(tick)
        parts.append(
            f'<line x1="{tx:.1f}" y1="{top}" x2="{tx:.1f}" y2="{axis_y}" stroke="#f3f4f6"/>'
        )
        anchor = "start" if n == 0 else ("end" if n == 5 else "middle")
        label = tick.astimezone(dt.UTC).strftime("%m-%d %H:%M:%S")
        parts.append(f'<text x="{tx:.1f}" y="{axis_y + 14}" text-anchor="{anchor}">{label}</text>')
    nx = x(now)
    parts.append(
        f'<line x1="{nx:.1f}" y1="{top}" x2="{nx:.1f}" y2="{axis_y}" stroke="#dc2626" '
        'stroke-dasharray="4 3"><title>now</title></line>'
    )
    for e in entries:
        assert e.at is not None
        cx = x(e.at)
        cy = top + lane_h * row.get(e.role, 0) + lane_h / 2
        tip = escape(
            f"{_t(e.at)}  {e.position}\n{e.description}"
            + (f"\nowner: {e.owner}" if e.owner else "")
            + (f"\nscheduler: {e.decision}" if e.decision else "")
        )
        fill = _color(e)
        if e.kind == "tombstone":
            shape = f'<rect x="{cx - 5:.1f}" y="{cy - 5:.1f}" width="10" height="10" fill="{fill}">'
            parts.append(f"{shape}<title>{tip}</title></rect>")
        elif e.kind in ("dead_letter", "undecodable"):
            a, b, c, e_ = cx - 5, cx + 5, cy - 5, cy + 5
            d = f"M{a:.1f} {c:.1f}L{b:.1f} {e_:.1f}M{b:.1f} {c:.1f}L{a:.1f} {e_:.1f}"
            parts.append(
                f'<path d="{d}" stroke="{fill}" stroke-width="3"><title>{tip}</title></path>'
            )
        else:
            ring = ' stroke="#111827" stroke-width="2"' if e.decision == "duplicate" else ""
            parts.append(
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="6" fill="{fill}"{ring}>'
                f"<title>{tip}</title></circle>"
            )
    parts.append("</svg>")
    return "".join(parts)


def _badge(verdict: Verdict) -> str:
    kind = verdict.kind.value
    cls = "badge ok" if kind in _OK else ("badge wait" if kind in _WAIT else "badge")
    cause = f" ({verdict.cause})" if verdict.cause else ""
    return f'<span class="{cls}">{escape(kind + cause)}</span>'


def render_item(item: ReportItem, now: dt.datetime) -> str:
    """One task or trigger: verdict, evidence, timeline picture and records (an HTML section)."""
    v = item.verdict
    title = v.task.ti_key if v.task else v.subject
    out = [
        f"<section><h2>{escape(title)}</h2>",
        f'<div class="summary">{_badge(v)} {escape(v.summary)}</div>',
        '<div class="meta">'
        + escape(
            f"try {v.task.try_number if v.task else '?'} · trigger {v.trigger_id or '-'} · "
            f"state {v.state or '-'}"
        )
        + "</div>",
        _svg(item, now),
        "<table><tr><th>time (UTC)</th><th>where</th><th>evidence</th></tr>",
    ]
    for ev in v.evidence:
        where = str(ev.position) if ev.position else "live groups"
        detail = f"<br><span class=meta>{escape(ev.detail)}</span>" if ev.detail else ""
        out.append(
            f'<tr><td class="mono">{_t(ev.at)}</td><td class="mono">{escape(where)}</td>'
            f"<td>{escape(ev.note)}{detail}</td></tr>"
        )
    out.append("</table>")
    traceback = v.facts.get("traceback")
    if traceback:
        out.append(
            "<details open><summary>traceback</summary>"
            f"<pre>{escape(str(traceback))}</pre></details>"
        )
    out.append(
        f"<details><summary>timeline ({len(item.timeline)} records)</summary><table>"
        "<tr><th>time (UTC)</th><th>topic[partition]@offset</th><th>record</th>"
        "<th>owner</th><th>scheduler</th></tr>"
    )
    for e in item.timeline:
        owner = "" if e.owner is None else (e.owner if e.owner_exact else f"~{e.owner}")
        out.append(
            f'<tr><td class="mono">{_t(e.at)}</td><td class="mono">{escape(str(e.position))}</td>'
            f"<td>{escape(e.description)}</td><td>{escape(owner)}</td>"
            f"<td>{escape(e.decision or '')}</td></tr>"
        )
    out.append("</table></details></section>")
    return "\n".join(out)


def render_html(title: str, items: Sequence[ReportItem], *, now: dt.datetime) -> str:
    """The whole report as one HTML document (inline CSS and SVG only)."""
    counts = Counter(i.verdict.kind.value for i in items)
    summary = ", ".join(f"{escape(k)}: {n}" for k, n in counts.most_common()) or "nothing"
    body = "\n".join(render_item(item, now) for item in items)
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{escape(title)}</title><style>{REPORT_CSS}</style></head><body>"
        f"<h1>{escape(title)}</h1>"
        f'<div class="meta">generated {escape(_t(now))} UTC · {len(items)} item(s) · '
        f"{summary}</div>\n{body}\n</body></html>\n"
    )
