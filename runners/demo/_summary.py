"""The demo's summary: what it measured, printed as a table (and written as JSON)."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["DemoSummary", "print_summary"]


@dataclasses.dataclass
class DemoSummary:
    """What the demo measured (also written as JSON with ``--summary-json``)."""

    tasks: int
    finished: int
    slots: int
    elapsed_seconds: float
    by_state: dict[str, int]
    by_kind: dict[str, list[int]]
    unexpected: list[str]
    duplicates_dropped: float
    worker_duplicate_runs: float
    runs_resent: float
    """RunTasks the scheduler sent again after a takeover without transactions."""
    events_applied: float
    events_by_status: dict[str, int]
    worker_slot_seconds: float
    blocking_slot_seconds: float
    deferred_peak: int
    failover: dict[str, Any] | None
    crashed: list[str]
    logs: str | None
    ok: bool


def print_summary(summary: DemoSummary, console: Console) -> None:
    table = Table(title="deferline demo: summary", show_header=False)
    table.add_column("")
    table.add_column("", justify="right")
    table.add_row(
        "tasks finished", f"{summary.finished}/{summary.tasks} in {summary.elapsed_seconds:.1f}s"
    )
    for state, n in summary.by_state.items():
        table.add_row(f"  {state}", str(n))
    table.add_row(
        "trigger events", ", ".join(f"{k} {v}" for k, v in sorted(summary.events_by_status.items()))
    )
    table.add_row("duplicate events dropped by the scheduler", f"{summary.duplicates_dropped:.0f}")
    table.add_row("peak tasks deferred at once", str(summary.deferred_peak))
    table.add_row(
        f"worker-slot-seconds used ({summary.slots} slots)", f"{summary.worker_slot_seconds:.1f}"
    )
    ratio = (
        summary.blocking_slot_seconds / summary.worker_slot_seconds
        if summary.worker_slot_seconds
        else 0.0
    )
    table.add_row(
        "slot-seconds blocking sensors would have held",
        f"{summary.blocking_slot_seconds:.1f}" + (f"  ({ratio:.0f}x)" if ratio else ""),
    )
    if summary.failover:
        f = summary.failover
        moved = f"{f['moved_after']:.1f}s" if f.get("moved_after") is not None else "not observed"
        table.add_row(
            f"failover: {f['victim']} SIGKILLed at {f['killed_after']:.1f}s",
            f"partitions {','.join(map(str, f['partitions'])) or '-'} → {f['survivor']} in {moved}",
        )
    if summary.unexpected:
        table.add_row("[red]unexpected outcomes", ", ".join(summary.unexpected[:10]))
    if summary.crashed:
        table.add_row("[red]crashed", ", ".join(summary.crashed))
    if summary.logs:
        table.add_row("process logs", summary.logs)
    console.print(table)
    console.print(
        "[bold green]demo OK[/]" if summary.ok else "[bold red]demo did not finish cleanly[/]"
    )
