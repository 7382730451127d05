"""Text for people (rich tables on stdout, progress on stderr) and JSON for machines."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import orjson
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from ._collect import StuckReport
from ._redrive import RedrivePlan
from ._timeline import TimelineEntry
from ._verdict import Verdict, VerdictKind

__all__ = [
    "RichProgress",
    "dump_json",
    "render_redrive",
    "render_stuck",
    "render_timeline",
    "render_verdict",
]

_STYLE: dict[VerdictKind, str] = {
    VerdictKind.RESUMED: "green",
    VerdictKind.NOT_DEFERRED: "green",
    VerdictKind.WATCH: "green",
    VerdictKind.RUNNING: "cyan",
    VerdictKind.WAITING: "cyan",
    VerdictKind.NOT_FOUND: "dim",
}


def _t(value: dt.datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def dump_json(data: Any) -> str:
    """Indented JSON (datetimes as ISO strings)."""
    return orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()


class _Rate(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} rec/s" if speed else "", style="progress.data.speed")


class RichProgress:
    """A rich progress bar per pass (records read of the range, rate) on stderr."""

    def __init__(self, console: Console, *, quiet: bool = False) -> None:
        self.console = console
        self.quiet = quiet
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._label = ""
        self._count = 0
        self._started = 0.0

    def begin(self, label: str, total: int) -> None:
        self._label, self._count, self._started = label, 0, time.monotonic()
        if self.quiet:
            return
        self._progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            _Rate(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(label, total=max(total, 1))

    def advance(self, records: int) -> None:
        self._count += records
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=records)

    def resize(self, total: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, total=max(total, 1))

    def end(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.quiet:
            return
        took = max(time.monotonic() - self._started, 1e-9)
        self.console.print(
            f"[dim]{self._label}: {self._count:,} records in {took:.1f} s "
            f"({self._count / took:,.0f} rec/s)[/dim]"
        )


def _verdict_line(verdict: Verdict) -> Text:
    style = _STYLE.get(verdict.kind, "bold red")
    label = verdict.kind.value + (f" ({verdict.cause})" if verdict.cause else "")
    return Text.assemble((label, style))


def render_verdict(
    console: Console, verdict: Verdict, timeline: Sequence[TimelineEntry] = ()
) -> None:
    """A verdict: the one-line answer, the task/trigger, the evidence, then facts."""
    console.print(Text.assemble(("why ", "bold"), (verdict.subject, "bold")))
    console.print(Text.assemble("  verdict: ", _verdict_line(verdict)))
    console.print(f"  {escape(verdict.summary)}", soft_wrap=True)
    if verdict.task is not None:
        console.print(f"  task:    {escape(str(verdict.task))}  state={verdict.state or '-'}")
    if verdict.trigger_id:
        console.print(f"  trigger: {verdict.trigger_id}")
    if verdict.evidence:
        table = Table(title="evidence", title_justify="left", box=None, pad_edge=False)
        table.add_column("time (UTC)", no_wrap=True)
        table.add_column("where", no_wrap=True)
        table.add_column("what")
        for ev in verdict.evidence:
            where = str(ev.position) if ev.position else "live groups"
            what = ev.note + (f"\n[dim]{escape(ev.detail)}[/dim]" if ev.detail else "")
            table.add_row(_t(ev.at), escape(where), what if ev.detail else escape(ev.note))
        console.print(table)
    facts = {k: v for k, v in verdict.facts.items() if k != "traceback"}
    if facts:
        console.print(
            "  facts:   " + ", ".join(f"{k}={_fact(v)}" for k, v in sorted(facts.items())),
            soft_wrap=True,
            markup=False,
        )
    traceback = verdict.facts.get("traceback")
    if traceback:
        console.print("  traceback:", markup=False)
        console.print(str(traceback).rstrip(), markup=False, highlight=False)
    if timeline:
        render_timeline(console, timeline)


def _fact(value: Any) -> str:
    if isinstance(value, dt.datetime):
        return _t(value)
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def render_timeline(console: Console, entries: Sequence[TimelineEntry]) -> None:
    """Every record in time order, where it lives, who owned its partition, what dedup did."""
    table = Table(title="timeline", title_justify="left", box=None, pad_edge=False)
    table.add_column("time (UTC)", no_wrap=True)
    table.add_column("topic[partition]@offset", no_wrap=True)
    table.add_column("record")
    table.add_column("owner", no_wrap=True)
    table.add_column("scheduler", no_wrap=True)
    for e in entries:
        owner = "-" if e.owner is None else (e.owner if e.owner_exact else f"~{e.owner}")
        table.add_row(
            _t(e.at),
            escape(str(e.position)),
            escape(e.description),
            escape(owner),
            e.decision or "",
        )
    if not entries:
        console.print("no records")
        return
    console.print(table)


def render_stuck(console: Console, reports: Sequence[StuckReport], *, older_than: str) -> None:
    """One row per stuck task, then counts per verdict."""
    if not reports:
        console.print(f"no task has waited on a trigger for more than {older_than}")
        return
    table = Table(box=None, pad_edge=False)
    for col in ("task", "try", "waiting", "age", "trigger", "verdict", "why"):
        table.add_column(col, no_wrap=col not in ("why", "task"))
    for report in reports:
        v = report.verdict
        task = v.task
        table.add_row(
            escape(task.ti_key if task else report.waiting.ti_key),
            str(task.try_number) if task else "?",
            report.waiting.state,
            _age(report.age.total_seconds() if report.age is not None else None),
            v.trigger_id or report.waiting.trigger_id,
            _verdict_line(v),
            escape(v.summary),
        )
    console.print(table)
    counts = Counter(r.verdict.kind.value for r in reports)
    console.print(
        f"{len(reports)} stuck (> {older_than}): "
        + ", ".join(f"{k} {n}" for k, n in counts.most_common())
    )


def render_redrive(
    console: Console, plans: Sequence[RedrivePlan], *, dry_run: bool, published: int
) -> None:
    table = Table(box=None, pad_edge=False)
    for col in ("trigger", "task", "verdict", "action", "reason"):
        table.add_column(col, no_wrap=col in ("trigger", "action"))
    for plan in plans:
        task = plan.verdict.task
        action = (
            plan.action if plan.action == "skip" else ("would publish" if dry_run else "published")
        )
        table.add_row(
            plan.trigger_id,
            escape(task.ti_key) if task else "?",
            plan.verdict.kind.value,
            action,
            escape(plan.reason + (f" -> {plan.topic}[{plan.partition}]" if plan.topic else "")),
        )
    console.print(table)
    wanted = sum(1 for p in plans if p.action == "publish")
    if dry_run:
        console.print(f"dry run: {wanted} of {len(plans)} would be re-published")
    else:
        console.print(f"re-published {published} of {len(plans)}")
