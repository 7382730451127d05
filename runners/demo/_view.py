"""The demo's live view: the children's metrics, scraped, and the screen drawn from them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ._children import Children
from ._plan import KINDS, DemoOptions
from ._watch import FINAL_STATES, STATE_ORDER, Watch

__all__ = ["Failover", "Scrapes", "poll_children", "render", "scrape"]


_STATE_STYLE = {
    "scheduled": "grey62",
    "queued": "cyan",
    "running": "bold yellow",
    "deferred": "magenta",
    "up_for_retry": "yellow",
    "success": "green",
    "failed": "red",
    "skipped": "blue",
    "removed": "grey50",
}


async def scrape(
    session: aiohttp.ClientSession, port: int | None
) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``name -> [(labels, value)]`` from a child's /metrics, or {} if it does not answer."""
    if port is None:
        return {}
    try:
        async with session.get(
            f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=1)
        ) as response:
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return {}
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return found


def _value(
    metrics: Mapping[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    return sum(
        value
        for got, value in metrics.get(name, ())
        if all(got.get(k) == v for k, v in labels.items())
    )


@dataclasses.dataclass
class Failover:
    """What happened when a triggerer was killed."""

    victim: str
    survivor: str
    killed_after: float
    partitions: list[int]
    moved_after: float | None = None


@dataclasses.dataclass
class Scrapes:
    owned: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    running: dict[str, float] = dataclasses.field(default_factory=dict)
    worker: dict[str, float] = dataclasses.field(default_factory=dict)
    # Per scheduler: its last scrape (a killed one's counters stay as they were) and how
    # many task partitions it owned then.
    schedulers: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    partitions_owned: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def scheduler(self) -> dict[str, float]:
        """The schedulers' figures added up (each owns a share of the partitions)."""
        total: dict[str, float] = {}
        for figures in self.schedulers.values():
            for name, value in figures.items():
                total[name] = total.get(name, 0.0) + value
        return total

    @property
    def busiest_scheduler(self) -> str:
        """The scheduler owning the most partitions (the one a demo kill takes down)."""
        owned = self.partitions_owned
        return max(sorted(owned), key=lambda name: owned[name], default="scheduler")


async def poll_children(children: Children, scrapes: Scrapes) -> None:
    async with aiohttp.ClientSession() as session:
        while True:
            for child in list(children.children.values()):
                if child.metrics_port is None:
                    continue
                got = await scrape(session, child.metrics_port) if child.alive else {}
                if child.name.startswith("triggerer"):
                    scrapes.owned[child.name] = sorted(
                        int(labels["partition"])
                        for labels, _ in got.get("deferline_triggerer_active_triggers", ())
                    )
                    scrapes.running[child.name] = _value(got, "deferline_triggers_running")
                elif child.name.startswith("scheduler"):
                    if not got:  # gone: it owns nothing; what it did still counts
                        scrapes.partitions_owned[child.name] = 0.0
                        for gauge in ("pending", "slots"):
                            scrapes.schedulers.get(child.name, {}).pop(gauge, None)
                        continue
                    scrapes.partitions_owned[child.name] = _value(
                        got, "deferline_scheduler_partitions_owned"
                    )
                    scrapes.schedulers[child.name] = {
                        "duplicates": _value(got, "deferline_scheduler_duplicates_dropped_total"),
                        "applied": _value(
                            got, "deferline_scheduler_events_total", verdict="applied"
                        ),
                        "resumes": _value(
                            got, "deferline_scheduler_runs_enqueued_total", mode="resume"
                        ),
                        "starts": _value(
                            got, "deferline_scheduler_runs_enqueued_total", mode="start"
                        ),
                        "resent": _value(got, "deferline_scheduler_runs_resent_total"),
                        "pending": _value(got, "deferline_scheduler_pending_events"),
                        "slots": _value(got, "deferline_scheduler_pool_slots_used"),
                    }
                elif child.name == "worker" and got:
                    scrapes.worker = {
                        "slot_seconds": _value(got, "deferline_worker_slot_seconds_total")
                        or _value(got, "deferline_worker_slot_seconds"),
                        "busy": _value(got, "deferline_worker_slots_busy"),
                        "duplicates": _value(got, "deferline_worker_duplicates_total"),
                    }
            await asyncio.sleep(0.5)


# -- the view ------------------------------------------------------------------------------------


def render(
    watch: Watch,
    scrapes: Scrapes,
    children: Children,
    failover: Failover | None,
    options: DemoOptions,
    elapsed: float,
    note: str,
) -> Group:
    total = len(watch.kind_of)
    counts = watch.by_state()
    finished = sum(counts[s] for s in FINAL_STATES)
    header = Text.assemble(
        ("deferline demo", "bold"),
        f"  {elapsed:5.1f}s  ",
        (f"{finished}/{total} tasks finished", "bold green" if finished == total else ""),
        f"   {note}",
    )
    states = Table(title="Task states", expand=True, show_edge=False)
    states.add_column("state")
    states.add_column("tasks", justify="right")
    states.add_column("", ratio=1)
    for state in STATE_ORDER:
        n = counts.get(state, 0)
        if n or state in ("scheduled", "running", "deferred", "success", "failed"):
            states.add_row(
                Text(state, style=_STATE_STYLE.get(state, "")),
                str(n),
                ProgressBar(
                    total=max(total, 1),
                    completed=n,
                    complete_style=_STATE_STYLE.get(state, "white"),
                ),
            )
    kinds = Table(title="By kind (finished / total)", expand=True, show_edge=False)
    kinds.add_column("kind")
    kinds.add_column("done", justify="right")
    labels = {kind: label for kind, _, label in KINDS}
    for kind, (done, all_) in watch.by_kind().items():
        kinds.add_row(labels[kind], f"{done}/{all_}")
    procs = Table(title="Processes", expand=True, show_edge=False)
    procs.add_column("process")
    procs.add_column("status")
    procs.add_column("partitions / figures")
    for child in children.children.values():
        status = (
            Text("running", style="green")
            if child.alive
            else Text("SIGKILLed" if child.killed_at else "exited", style="bold red")
        )
        if child.name.startswith("triggerer"):
            owned = scrapes.owned.get(child.name, [])
            detail = (
                f"{len(owned):2d} partitions {','.join(map(str, owned)) or '-'}; "
                f"{scrapes.running.get(child.name, 0):.0f} triggers running, "
                f"{watch.events_by_member[child.name]} events emitted"
            )
        elif child.name == "scheduler":
            s = scrapes.scheduler
            detail = (
                f"{s.get('applied', 0):.0f} events applied, "
                f"{s.get('duplicates', 0):.0f} duplicates dropped, "
                f"{s.get('resumes', 0):.0f} resumes enqueued"
            )
        else:
            w = scrapes.worker
            busy = w.get("busy", 0)
            detail = (
                f"{busy:.0f}/{options.slots} slots busy, {watch.slot_seconds:.1f} slot-seconds "
                f"used; {watch.deferred_now} tasks deferred, holding no slot"
            )
        procs.add_row(child.name, status, detail)
    parts: list[Any] = [header, states, kinds, procs]
    if failover is not None:
        lines = [
            f"t={failover.killed_after:.1f}s  SIGKILL {failover.victim} "
            f"(owned partitions {', '.join(map(str, failover.partitions)) or '-'})"
        ]
        if failover.moved_after is not None:
            lines.append(
                f"t={failover.killed_after + failover.moved_after:.1f}s  "
                f"{failover.survivor} owns them: triggers running again after "
                f"{failover.moved_after:.1f}s "
                f"(session timeout {options.session_timeout_ms / 1000:.0f}s)"
            )
        else:
            lines.append(f"waiting for the group to move them to {failover.survivor}...")
        parts.append(Panel("\n".join(lines), title="Failover", border_style="red"))
    return Group(*parts)
