"""Fire throughput of the trigger supervisor: N timers due at the same instant.

Airflow's figure (ANCHORS.md) is measured the same way: N DateTimeTriggers that all fall due
at one moment, from the due time until every one has fired. Here "fired" means the outcome
reached the supervisor's ``on_event`` callback (the runner then produces it to Kafka; that
part is measured with the runner). Each case runs in a fresh subprocess.

Reported: due → all fired (s), events/s through on_event, fire lag (fired_at - due_at) p50 /
p99 / max, and CPU per fired trigger. The "coroutine" case forces the general path (one task
per trigger, each sleeping until the moment) for comparison with the shared timer heap.

Run: .venv/bin/python -m bench.bench_engine_fire   (from the repository root)
     add --case timers --n 100000 to run one case in this process.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from bench._figures import Figure, size_slug
from bench._harness import RunCase, main, quantile

AIRFLOW = {1_000: (1.9, 523), 10_000: (13.5, 742)}  # due → all fired (s), fires/s; ANCHORS.md
CASES = [
    ("timers", 1_000),
    ("timers", 10_000),
    ("timers", 100_000),
    ("coroutines", 10_000),
    ("coroutines", 100_000),
]


async def measure(case: str, n: int) -> dict[str, Any]:
    from deferline.engine import TriggerEvent, TriggerOutcome, TriggerSupervisor
    from deferline.engine.triggers import DateTimeTrigger

    class CoroutineDateTime(DateTimeTrigger):
        """Same behaviour, but overriding run() keeps it off the timer fast path."""

        async def run(self) -> AsyncIterator[TriggerEvent]:
            while True:
                wait = (self.moment - dt.datetime.now(dt.UTC)).total_seconds()
                if wait <= 0:
                    break
                await asyncio.sleep(wait)
            yield TriggerEvent(self.moment)

    logging.getLogger("deferline.engine").setLevel(logging.ERROR)  # the add burst blocks
    outcomes: list[TriggerOutcome] = []
    done = asyncio.Event()

    def on_event(outcome: TriggerOutcome) -> None:
        outcomes.append(outcome)
        if len(outcomes) == n:
            done.set()

    cls = DateTimeTrigger if case == "timers" else CoroutineDateTime
    ids = [str(uuid.uuid4()) for _ in range(n)]
    margin = 1.0 + n / (20_000 if case == "timers" else 5_000)
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=margin)
    async with TriggerSupervisor(capacity=n, on_event=on_event) as sup:
        for tid in ids:
            sup.add(tid, cls(due))
        await asyncio.sleep(0)
        assert not outcomes, "setup took longer than the margin"
        assert sup.waiting_timers == (n if case == "timers" else 0)
        await asyncio.sleep(max(0.0, (due - dt.datetime.now(dt.UTC)).total_seconds() - 0.05))
        cpu0 = time.process_time()
        await done.wait()
        cpu = time.process_time() - cpu0
    assert all(o.status == "fired" for o in outcomes)
    fired = sorted(o.fired_at for o in outcomes if o.fired_at is not None)
    lags = sorted((at - due).total_seconds() for at in fired)
    span = (fired[-1] - fired[0]).total_seconds()
    return {
        "case": case,
        "n": n,
        "due_to_all_fired_s": (fired[-1] - due).total_seconds(),
        "events_per_s": n / max(span, 1e-9),
        "lag_p50_ms": quantile(lags, 0.50) * 1000,
        "lag_p99_ms": quantile(lags, 0.99) * 1000,
        "lag_max_ms": lags[-1] * 1000,
        "cpu_us_per_trigger": cpu / n * 1e6,
    }


def report(run: RunCase) -> list[Figure]:
    figures = []
    print(
        "| N due at once | path | due → all fired | events/s | lag p50 | lag p99 | lag max "
        "| CPU / trigger | vs Airflow (due → all fired) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case, n in CASES:
        r = run(case, n)
        path = "timer heap" if case == "timers" else "coroutine each"
        airflow = AIRFLOW.get(n)
        versus = (
            f"{airflow[0] / r['due_to_all_fired_s']:,.0f}x faster ({airflow[0]} s)"
            if airflow
            else "—"
        )
        print(
            f"| {n:,} | {path} | {r['due_to_all_fired_s'] * 1000:,.0f} ms "
            f"| {r['events_per_s']:,.0f} | {r['lag_p50_ms']:.1f} ms | {r['lag_p99_ms']:.1f} ms "
            f"| {r['lag_max_ms']:.1f} ms | {r['cpu_us_per_trigger']:.1f} µs | {versus} |"
        )
        what = f"{n:,} {'timers' if case == 'timers' else 'coroutine triggers'} due at once"
        anchor = (
            f"; Airflow 2.10.5's triggerer: {airflow[0]} s ({airflow[1]}/s), anchors, an "
            "earlier sitting"
            if airflow
            else ""
        )
        figures += [
            Figure(
                f"engine.fire_{case}_{size_slug(n)}",
                f"{what} → all fired",
                round(r["due_to_all_fired_s"] * 1000, 1),
                "ms",
                note=f"{r['events_per_s']:,.0f} events/s; lag p99 {r['lag_p99_ms']:.1f} ms{anchor}",
            ),
            Figure(
                f"engine.fire_cpu_{case}_{size_slug(n)}",
                f"{what}: CPU per {'fired timer' if case == 'timers' else 'trigger'}",
                round(r["cpu_us_per_trigger"], 2),
                "µs",
            ),
        ]
    return figures


if __name__ == "__main__":
    main(cases=("timers", "coroutines"), measure=measure, report=report)
