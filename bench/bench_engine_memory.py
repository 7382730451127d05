"""RSS per waiting trigger and creation rate of the trigger supervisor.

Cases (each measured in a fresh subprocess so one cannot inflate the next):
  * N timer triggers (DateTimeTrigger, the shared-heap fast path), N = 100,000 and 1,000,000;
  * N generic coroutine triggers (each waits on an asyncio.Event), N = 100,000.

Bytes per trigger = (RSS with N waiting triggers - RSS before) / N. It includes the trigger
ids (36-character strings, as the runner keeps them), the supervisor's per-trigger entries
and, for coroutine triggers, the trigger object, its generator and its task.
Creation rate = triggers constructed and added per second.

Run: .venv/bin/python -m bench.bench_engine_memory   (from the repository root)
     add --case timers --n 100000 to run one case in this process.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from bench._figures import Figure, size_slug
from bench._harness import RunCase, main

AIRFLOW_BYTES_PER_TRIGGER = 24 * 1024  # measured Airflow 2.10.5 triggerer, see ANCHORS.md
CASES = [("timers", 100_000), ("timers", 1_000_000), ("coroutines", 100_000)]


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def measure(case: str, n: int) -> dict[str, Any]:
    from deferline.engine import BaseTrigger, TriggerEvent, TriggerSupervisor
    from deferline.engine.triggers import DateTimeTrigger

    class Waiter(BaseTrigger):
        """A generic coroutine trigger: waits for an event that never comes here."""

        started = 0

        def __init__(self, gate: asyncio.Event) -> None:
            super().__init__()
            self.gate = gate

        def serialize(self) -> tuple[str, dict[str, Any]]:
            return ("bench.Waiter", {})

        async def run(self) -> AsyncIterator[TriggerEvent]:
            Waiter.started += 1
            if Waiter.started == n:
                all_started.set()
            await self.gate.wait()
            yield TriggerEvent(None)

    all_started = asyncio.Event()

    # Adding N triggers in one synchronous burst blocks the loop on purpose; keep the
    # watchdog running (as in production) but quiet.
    logging.getLogger("deferline.engine").setLevel(logging.ERROR)
    fired: list[object] = []
    sup = TriggerSupervisor(capacity=n, on_event=fired.append)
    await sup.start()
    gate = asyncio.Event()
    start_moment = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    step = dt.timedelta(microseconds=1000)
    gc.collect()
    before = rss_bytes()
    ids = [str(uuid.uuid4()) for _ in range(n)]
    t0 = time.perf_counter()
    if case == "timers":
        for i, tid in enumerate(ids):
            sup.add(tid, DateTimeTrigger(start_moment + i * step))
    else:
        for tid in ids:
            sup.add(tid, Waiter(gate))
    created = time.perf_counter() - t0
    # Let every coroutine trigger reach its first await, so each holds its full state.
    if case == "coroutines":
        await all_started.wait()
    await asyncio.sleep(0.05)
    settled = time.perf_counter() - t0
    gc.collect()
    after = rss_bytes()
    assert len(sup) == n
    assert sup.running == n
    assert not fired
    result = {
        "case": case,
        "n": n,
        "rss_before_mb": before / 2**20,
        "rss_after_mb": after / 2**20,
        "bytes_per_trigger": (after - before) / n,
        "created_per_s": n / created,
        "settled_s": settled,
        "waiting_timers": sup.waiting_timers,
    }
    await sup.stop()
    return result


def report(run: RunCase) -> list[Figure]:
    figures = []
    print(
        "| triggers waiting | kind | RSS before → after | bytes / trigger "
        "| vs Airflow (24 KB) | created / s |"
    )
    print("|---|---|---|---|---|---|")
    for case, n in CASES:
        r = run(case, n)
        kind = "timer (shared heap)" if case == "timers" else "coroutine (task each)"
        print(
            f"| {n:,} | {kind} | {r['rss_before_mb']:.0f} → {r['rss_after_mb']:.0f} MB "
            f"| {r['bytes_per_trigger']:,.0f} B "
            f"| {AIRFLOW_BYTES_PER_TRIGGER / r['bytes_per_trigger']:.0f}x smaller "
            f"| {r['created_per_s']:,.0f} |"
        )
        kind = "timer" if case == "timers" else "coroutine"
        what = f"{n:,} waiting {'timers' if case == 'timers' else 'coroutine triggers'}"
        figures += [
            Figure(
                f"engine.{kind}_memory_{size_slug(n)}",
                f"{what}: memory each",
                round(r["bytes_per_trigger"]),
                "B",
                note=f"RSS {r['rss_before_mb']:.0f} → {r['rss_after_mb']:.0f} MB; Airflow's "
                "triggerer: ≈ 24 KB per waiting trigger, anchors, an earlier sitting",
            ),
            Figure(
                f"engine.{kind}_created_{size_slug(n)}",
                f"{what}: created per second",
                round(r["created_per_s"]),
                "/s",
            ),
        ]
    return figures


if __name__ == "__main__":
    main(cases=("timers", "coroutines"), measure=measure, report=report)
