"""One ``deferline demo`` run: the whole loop on the embedded broker, watched live.

Starts the embedded Tansu broker, two triggerers, a scheduler and a worker with 4 slots as
``deferline`` subprocesses; submits tasks that wait on timers, files (created by a helper
here), HTTP (a local aiohttp server), Kafka messages, deadlines that time out and triggers
that end the task themselves; shows task states live; SIGKILLs one triggerer halfway and
shows its partitions move to the other; ends with a summary. Every child runs in its own
process group and is stopped on the way out, on Ctrl-C and on errors too (and the kernel
kills it if this process dies first).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from deferline.client import Client
from deferline.schemas import DeferlineError
from deferline.topics import (
    KRaftBroker,
    Settings,
    TansuBroker,
    TopicSpec,
    ensure_topics,
    topic_specs,
)
from rich.console import Console
from rich.live import Live

from ._children import RUN_MARKER_ENV, Children, start_processes
from ._conditions import ConditionHelpers
from ._plan import DemoOptions, TaskSpec, make_plan
from ._summary import DemoSummary
from ._view import Failover, Scrapes, poll_children, render
from ._watch import STATE_ORDER, Watch, watch_topics

__all__ = ["DemoError", "run_demo"]


class DemoError(DeferlineError):
    """The demo could not run to its end."""


async def run_demo(options: DemoOptions, console: Console) -> DemoSummary:
    """Run the demo end to end; always leaves no child process behind."""
    prefix = options.topic_prefix or f"demo-{uuid.uuid4().hex[:8]}."
    workdir = Path(tempfile.mkdtemp(prefix="deferline-demo-"))
    files = workdir / "files"
    files.mkdir()
    began = time.monotonic()
    os.environ.setdefault(RUN_MARKER_ENV, prefix)
    keep_logs = False
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(lambda: None if keep_logs else shutil.rmtree(workdir, ignore_errors=True))
        kafka = options.broker == "kafka"
        console.print(
            f"[bold]deferline demo[/]: {options.tasks} tasks, starting "
            + ("Apache Kafka (KRaft)..." if kafka else "the embedded broker...")
        )
        broker = KRaftBroker() if kafka else TansuBroker()
        await broker.start()
        stack.push_async_callback(broker.stop)
        settings = Settings(bootstrap_servers=broker.bootstrap, topic_prefix=prefix, partitions=12)
        signals = f"{prefix}signals"
        await ensure_topics(settings, [*topic_specs(settings), TopicSpec(signals, 1, 1)])
        env = {
            **os.environ,
            "DEFERLINE_BOOTSTRAP_SERVERS": broker.bootstrap,
            "DEFERLINE_TOPIC_PREFIX": prefix,
            "DEFERLINE_PARTITIONS": "12",
            RUN_MARKER_ENV: prefix,
            "PYTHONUNBUFFERED": "1",
        }
        children = Children(env, workdir)
        stack.push_async_callback(children.stop_all)
        start_processes(children, options)

        helpers = ConditionHelpers(settings=settings, topic=signals)
        http_base = await helpers.start_http()
        stack.push_async_callback(helpers.stop_http)
        specs = make_plan(options, files=files, http_base=http_base, signals_topic=signals)
        helpers.plan(specs)

        watch = Watch(specs, dag_id="demo")
        scrapes = Scrapes()
        failover: Failover | None = None
        background = await stack.enter_async_context(_Background())
        background.spawn(watch_topics(settings, watch))
        background.spawn(poll_children(children, scrapes))

        async with Client(settings) as client:
            first, *rest = specs
            await _submit(client, first)
            for chunk in _chunks(rest, 200):
                await asyncio.gather(*(_submit(client, spec) for spec in chunk))
        helpers.started = time.monotonic()
        background.spawn(helpers.run(_DoneView(watch)))

        total = len(specs)
        deadline = began + options.deadline
        view = (
            Live(console=console, refresh_per_second=4, transient=False) if options.live else None
        )
        last_line = 0.0
        note = "tasks submitted"
        try:
            if view is not None:
                view.start()
            while True:
                now = time.monotonic()
                finished = len(watch.finished())
                crashed = children.crashed()
                if crashed:
                    keep_logs = True
                    raise DemoError(
                        f"{', '.join(c.name for c in crashed)} exited; logs in {workdir}"
                    )
                halfway = finished >= total / 2 or now - helpers.started >= options.duration * 0.6
                victim, survivor = "triggerer-a", "triggerer-b"
                owned = list(scrapes.owned.get(victim, []))
                if options.kill and failover is None and halfway and owned:
                    children.sigkill(victim)
                    failover = Failover(victim, survivor, now - began, owned)
                    note = f"SIGKILLed {victim}"
                    if options.kill_scheduler:
                        scheduler = scrapes.busiest_scheduler
                        children.sigkill(scheduler)
                        note += f" and {scheduler}"
                if failover is not None and failover.moved_after is None:
                    survivor_owns = set(scrapes.owned.get(failover.survivor, []))
                    if len(survivor_owns) == 12:
                        failover.moved_after = now - began - failover.killed_after
                        note = f"{failover.survivor} took over"
                elapsed = now - began
                if view is not None:
                    view.update(render(watch, scrapes, children, failover, options, elapsed, note))
                elif now - last_line >= 5.0:
                    last_line = now
                    counts = watch.by_state()
                    console.print(
                        f"{elapsed:5.1f}s  finished {finished}/{total}  "
                        + "  ".join(f"{s}={counts[s]}" for s in STATE_ORDER if counts.get(s))
                        + (f"  [{note}]" if note else ""),
                        soft_wrap=True,
                        highlight=False,
                        markup=False,
                    )
                if finished >= total:
                    break
                if now >= deadline:
                    keep_logs = True
                    break
                await asyncio.sleep(0.25)
        finally:
            if view is not None:
                view.stop()
        # Let the last scrape of the scheduler's counters land.
        await asyncio.sleep(0.6)
        counts = watch.by_state()
        summary = DemoSummary(
            tasks=total,
            finished=len(watch.finished()),
            slots=options.slots,
            elapsed_seconds=round(time.monotonic() - began, 2),
            by_state={s: counts[s] for s in STATE_ORDER if counts.get(s)},
            by_kind={k: list(v) for k, v in watch.by_kind().items()},
            unexpected=[k.split("/")[1] for k in watch.unexpected()],
            duplicates_dropped=scrapes.scheduler.get("duplicates", 0.0),
            worker_duplicate_runs=scrapes.worker.get("duplicates", 0.0),
            runs_resent=scrapes.scheduler.get("resent", 0.0),
            events_applied=scrapes.scheduler.get("applied", 0.0),
            events_by_status=dict(watch.events),
            worker_slot_seconds=round(watch.slot_seconds, 2),
            blocking_slot_seconds=round(watch.blocking_seconds, 2),
            deferred_peak=watch.deferred_peak,
            failover=dataclasses.asdict(failover) if failover is not None else None,
            crashed=[c.name for c in children.crashed()],
            logs=str(workdir) if keep_logs else None,
            ok=False,
        )
        summary.ok = (
            summary.finished == summary.tasks and not summary.unexpected and not summary.crashed
        )
        if not summary.ok:
            keep_logs = True
            summary.logs = str(workdir)
        console.print("stopping processes...")
    return summary


class _DoneView:
    """A live set view of finished task names for the Kafka signaller."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and f"demo/{name}/run/-1" in self.watch.finished()


class _Background:
    """Tasks that live as long as the demo; cancelled (and awaited) on the way out."""

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[Any]] = []

    async def __aenter__(self) -> _Background:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        task.add_done_callback(_raise_in_loop)
        self._tasks.append(task)


def _raise_in_loop(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        loop = task.get_loop()
        loop.call_exception_handler(
            {"message": "demo background task failed", "exception": task.exception(), "task": task}
        )


async def _submit(client: Client, spec: TaskSpec) -> None:
    await client.submit(
        spec.operator, dag_id="demo", task_id=spec.name, run_id="run", op_kwargs=spec.op_kwargs
    )


def _chunks(items: Sequence[TaskSpec], size: int) -> Iterator[Sequence[TaskSpec]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
