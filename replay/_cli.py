"""`deferline replay ...`: timelines, verdicts, stuck deferrals, re-drive and local runs."""

from __future__ import annotations

import datetime as dt
import functools
import re
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click
from deferline.runners._options import connection_options
from deferline.schemas import DeferlineError, KwargsCipher
from deferline.topics import Settings, run_closing
from rich.console import Console

from ._collect import ReplaySession, StuckReport
from ._errors import ReplayError
from ._explain import explain
from ._html import ReportItem, render_html
from ._live import GroupHints
from ._redrive import plan_redrive, publish_redrives
from ._render import (
    RichProgress,
    dump_json,
    render_redrive,
    render_stuck,
    render_timeline,
    render_verdict,
)
from ._run import enable_asyncio_debug, run_trigger
from ._source import ReadBounds
from ._timeline import build_timeline
from ._verdict import Subject, parse_subject

__all__ = ["parse_duration", "parse_time", "replay"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")


def parse_duration(text: str) -> dt.timedelta:
    """``90``, ``90s``, ``10m``, ``1h30m``, ``2d``, ``500ms``."""
    value = text.strip().lower()
    try:
        return dt.timedelta(seconds=float(value))
    except ValueError:
        pass
    pos, total = 0, 0.0
    for match in _PART.finditer(value):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(value) or not value:
        raise ValueError(f"{text!r} is not a duration (use e.g. 90s, 10m, 1h30m, 2d)")
    return dt.timedelta(seconds=total)


def parse_time(text: str, *, now: dt.datetime) -> dt.datetime:
    """An ISO time (UTC when no offset is given), or a duration meaning that long ago."""
    try:
        value = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        try:
            return now - parse_duration(text)
        except ValueError:
            raise ValueError(
                f"{text!r} is neither an ISO time (2025-03-01T12:00:00Z) nor a duration (2h)"
            ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


# click 8.5 made ParamType generic; earlier versions (pulled in by the airflow extra) are not.
class _Duration(click.ParamType):  # type: ignore[type-arg, unused-ignore]
    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> dt.timedelta:
        if isinstance(value, dt.timedelta):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = _Duration()


def _read_options(func: F) -> F:
    """Options shared by every command that reads the topics."""
    options = [
        click.option(
            "--since",
            metavar="TIME",
            help="Read records from this time on: ISO time or a duration ago (2h).",
        ),
        click.option(
            "--until", metavar="TIME", help="Stop at this time: ISO time or a duration ago."
        ),
        click.option(
            "--from-offset",
            type=int,
            help="Start every partition at this offset (negative: that many before the end).",
        ),
        click.option("--to-offset", type=int, help="Stop every partition before this offset."),
        click.option(
            "--offline",
            is_flag=True,
            help="Do not read the live consumer groups (owners and lags then unknown).",
        ),
        click.option("--now", "now_text", metavar="TIME", help="Reference time (default: now)."),
        click.option(
            "--triggerer-group",
            multiple=True,
            help="Name of the triggerer group (default <prefix>triggerer[.<queue>]).",
        ),
        click.option("--scheduler-group", multiple=True, help="Default <prefix>scheduler."),
        click.option(
            "--worker-group", multiple=True, help="Default <prefix>worker.<worker queue>."
        ),
        click.option("-q", "--quiet", is_flag=True, help="No progress on stderr."),
        connection_options,
    ]
    for option in reversed(options):
        func = option(func)
    return func


class _Run:
    """What every reading command needs, built from the shared options."""

    def __init__(self, settings: Settings, options: dict[str, Any]) -> None:
        self.settings = settings
        self.err = Console(stderr=True)
        # Piped output is not cut to 80 columns.
        self.out = Console(width=None if sys.stdout.isatty() else 240)
        real_now = dt.datetime.now(dt.UTC)
        try:
            self.now = (
                parse_time(options["now_text"], now=real_now) if options["now_text"] else real_now
            )
            since = parse_time(options["since"], now=self.now) if options["since"] else None
            until = parse_time(options["until"], now=self.now) if options["until"] else None
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from exc
        self.bounds = ReadBounds(
            since=since,
            until=until,
            from_offset=options["from_offset"],
            to_offset=options["to_offset"],
        )
        defaults = GroupHints.for_prefix(settings.topic_prefix)
        self.hints = GroupHints(
            triggerer=tuple(options["triggerer_group"]) or defaults.triggerer,
            scheduler=tuple(options["scheduler_group"]) or defaults.scheduler,
            worker=tuple(options["worker_group"]) or defaults.worker,
        )
        self.offline = bool(options["offline"])
        self.progress = RichProgress(self.err, quiet=bool(options["quiet"]))
        try:
            self.cipher = KwargsCipher(settings.kwargs_keys) if settings.kwargs_keys else None
        except DeferlineError as exc:
            raise click.UsageError(str(exc)) from exc

    def session(self) -> ReplaySession:
        return ReplaySession(
            self.settings,
            bounds=self.bounds,
            progress=self.progress,
            live=not self.offline,
            hints=self.hints,
            cipher=self.cipher,
            now=self.now,
        )

    def write_html(self, path: str, title: str, items: list[ReportItem]) -> None:
        try:
            Path(path).write_text(render_html(title, items, now=self.now), encoding="utf-8")
        except OSError as exc:
            raise click.ClickException(f"cannot write {path}: {exc}") from exc
        # Whole, as written: a path wrapped at the terminal's width cannot be pasted.
        self.err.print(f"wrote {path}", soft_wrap=True, markup=False, highlight=False)


def _split(kwargs: dict[str, Any]) -> tuple[Settings, dict[str, Any]]:
    settings = kwargs.pop("settings")
    keys = (
        "since",
        "until",
        "from_offset",
        "to_offset",
        "offline",
        "now_text",
        "triggerer_group",
        "scheduler_group",
        "worker_group",
        "quiet",
    )
    return settings, {k: kwargs.pop(k) for k in keys}


def _arun(coro: Coroutine[Any, Any, T]) -> T:
    try:
        return run_closing(coro)
    except DeferlineError as exc:
        raise click.ClickException(str(exc)) from exc


def _subject(text: str) -> Subject:
    try:
        return parse_subject(text)
    except DeferlineError as exc:
        raise click.BadParameter(str(exc), param_hint="TASK_OR_TRIGGER") from exc


def _command(func: Callable[..., None]) -> Callable[..., None]:
    """Turn the shared options into a ``_Run`` as the first argument."""

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> None:
        settings, options = _split(kwargs)
        func(_Run(settings, options), **kwargs)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def replay() -> None:
    """Read the topics back: explain stuck deferrals, show timelines, re-drive triggers.

    TASK_OR_TRIGGER is a trigger id, or a task instance as dag_id/task_id/run_id with an
    optional /map_index and #try_number. Reading uses a consumer without a group: nothing is
    committed and production groups are untouched. Live consumer groups (who runs what, lags)
    are read with the admin API unless --offline.
    """


@replay.command()
@click.argument("subject", metavar="TASK_OR_TRIGGER")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--html", "html", metavar="FILE", help="Also write a self-contained HTML report.")
@_read_options
@_command
def timeline(run: _Run, subject: str, as_json: bool, html: str | None) -> None:
    """Every record about a task or trigger, in time order, with partition/offset and owner."""
    wanted = _subject(subject)

    async def go() -> Any:
        async with run.session() as session:
            entries = await session.timeline(wanted)
            verdict = None
            if html:
                assert session.index is not None
                verdict = explain(session.index, wanted, await session.context())
            return entries, verdict

    entries, verdict = _arun(go())
    if as_json:
        click.echo(dump_json({"subject": subject, "records": [e.to_json() for e in entries]}))
    else:
        render_timeline(run.out, entries)
    if html and verdict is not None:
        run.write_html(html, f"deferline timeline: {subject}", [ReportItem(verdict, entries)])


@replay.command()
@click.argument("subject", metavar="TASK_OR_TRIGGER")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON.")
@click.option("--timeline", "show_timeline", is_flag=True, help="Also print the timeline.")
@click.option("--html", "html", metavar="FILE", help="Also write a self-contained HTML report.")
@_read_options
@_command
def why(run: _Run, subject: str, as_json: bool, show_timeline: bool, html: str | None) -> None:
    """One verdict for a task or trigger, with the records that prove it."""
    wanted = _subject(subject)

    async def go() -> Any:
        async with run.session() as session:
            return await session.why(wanted)

    verdict, entries = _arun(go())
    if as_json:
        data = verdict.to_json()
        if show_timeline:
            data["timeline"] = [e.to_json() for e in entries]
        click.echo(dump_json(data))
    else:
        render_verdict(run.out, verdict, entries if show_timeline else ())
    if html:
        run.write_html(html, f"deferline why: {subject}", [ReportItem(verdict, entries)])


@replay.command()
@click.option(
    "--older-than",
    type=DURATION,
    default="10m",
    show_default=True,
    help="Only tasks waiting at least this long (e.g. 90s, 10m, 2h).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--html", "html", metavar="FILE", help="Also write a self-contained HTML report.")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    help="Explain only the N oldest (all are counted); bounds memory when very many are stuck.",
)
@_read_options
@_command
def stuck(
    run: _Run, older_than: dt.timedelta, as_json: bool, html: str | None, limit: int | None
) -> None:
    """Tasks deferred (or resumed and not started) longer than --older-than, with verdicts."""

    async def go() -> tuple[list[StuckReport], list[ReportItem], int]:
        async with run.session() as session:
            reports = await session.stuck(older_than=older_than, limit=limit)
            items = []
            if html and session.index is not None:
                for report in reports:
                    subject = Subject(report.waiting.ti_key, ti_key=report.waiting.ti_key)
                    entries = build_timeline(session.index, subject)
                    items.append(ReportItem(report.verdict, entries, report.waiting.since))
            return reports, items, session.waiting_total

    reports, items, total = _arun(go())
    label = _duration_text(older_than)
    if as_json:
        counts: dict[str, int] = {}
        for r in reports:
            counts[r.verdict.kind.value] = counts.get(r.verdict.kind.value, 0) + 1
        click.echo(
            dump_json(
                {
                    "now": run.now.isoformat(),
                    "older_than_s": older_than.total_seconds(),
                    "count": total,
                    "shown": len(reports),
                    "by_verdict": counts,
                    "tasks": [r.to_json() for r in reports],
                }
            )
        )
    else:
        render_stuck(run.out, reports, older_than=label)
        if total > len(reports):
            run.out.print(f"(showing the {len(reports)} oldest of {total})")
    if html:
        run.write_html(html, f"deferline: tasks waiting more than {label}", items)


def _duration_text(value: dt.timedelta) -> str:
    seconds = value.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


@replay.command()
@click.argument("triggers", nargs=-1, required=True, metavar="TRIGGER...")
@click.option("--dry-run", is_flag=True, help="Show what would be published; publish nothing.")
@click.option(
    "--force",
    is_flag=True,
    help="Also re-drive triggers that already have an event or were dead-lettered.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@_read_options
@_command
def redrive(
    run: _Run, triggers: tuple[str, ...], dry_run: bool, force: bool, as_json: bool
) -> None:
    """Publish the recorded DeferRequest of stuck triggers again, under the same trigger id.

    Same key, same partition: the request replaces itself in the compacted defer topic, and
    the scheduler's dedup (apply only while the task is deferred on that trigger) makes a
    double resume impossible. Triggers whose task is not deferred on them are refused.
    """
    for text in triggers:
        if _subject(text).trigger_id is None:
            raise click.BadParameter(f"{text!r} is not a trigger id", param_hint="TRIGGER")

    async def go() -> Any:
        plans = []
        async with run.session() as session:
            ctx = None
            for trigger_id in triggers:
                index = await session.collect(Subject(trigger_id, trigger_id=trigger_id))
                ctx = ctx or await session.context()
                plans.append(plan_redrive(index, trigger_id, ctx, force=force))
        published = 0 if dry_run else await publish_redrives(run.settings, plans)
        return plans, published

    plans, published = _arun(go())
    if as_json:
        click.echo(
            dump_json(
                {
                    "dry_run": dry_run,
                    "published": published,
                    "plans": [p.to_json() for p in plans],
                }
            )
        )
    else:
        render_redrive(run.out, plans, dry_run=dry_run, published=published)


@replay.command(name="run")
@click.argument("trigger", metavar="TRIGGER")
@click.option(
    "--timeout",
    "seconds",
    type=DURATION,
    default="60s",
    show_default=True,
    help="Give up after this long without an event.",
)
@click.option(
    "--keep-timeout", is_flag=True, help="Apply the request's recorded timeout_at as well."
)
@click.option("--all-events", is_flag=True, help="Keep running after the first event.")
@click.option(
    "--allow-prefix",
    multiple=True,
    help="Also allow trigger classes under this module prefix (in addition to the settings).",
)
@_read_options
@_command
def run_command(
    run: _Run,
    trigger: str,
    seconds: dt.timedelta,
    keep_timeout: bool,
    all_events: bool,
    allow_prefix: tuple[str, ...],
) -> None:
    """Run one trigger here from its recorded DeferRequest, with debug logging.

    Asyncio debug mode (PYTHONASYNCIODEBUG) and DEBUG logs are on; the supervisor's watchdog
    names the trigger if it blocks the event loop. Exit status: 0 fired, 1 failed or timed
    out, 2 cannot be built, 3 no event within --timeout.
    """
    wanted = _subject(trigger)
    if wanted.trigger_id is None:
        raise click.BadParameter(f"{trigger!r} is not a trigger id", param_hint="TRIGGER")
    trigger_id = wanted.trigger_id

    async def find() -> Any:
        async with run.session() as session:
            index = await session.collect(wanted)
        history = index.triggers.get(trigger_id)
        request = history.defer_request if history else None
        if request is None and history is not None and history.is_watch:
            raise ReplayError(
                f"trigger {trigger_id} is a standing watch (WatchRequest), not a deferral: "
                "`replay run` runs a recorded DeferRequest; `replay why` explains the watch"
            )
        if request is None:
            raise ReplayError(f"no DeferRequest recorded for trigger {trigger_id}")
        return request

    run.offline = True  # only the request is needed
    request = _arun(find())
    click.echo(
        f"request  {request.task} seq={request.defer_seq} "
        f"requested_at={request.requested_at.isoformat()}"
    )
    enable_asyncio_debug()
    allowed = [*run.settings.allowed_trigger_prefixes, *allow_prefix]
    result = run_closing(
        run_trigger(
            request,
            cipher=run.cipher,
            allowed_prefixes=allowed,
            seconds=seconds.total_seconds(),
            keep_timeout=keep_timeout,
            all_events=all_events,
            echo=click.echo,
        ),
        debug=True,
    )
    sys.exit(result.exit_code)
