"""Airflow's own DateTimeTrigger under deferline's supervisor, beside deferline's DateTimeTrigger.

N triggers loaded through ``load_trigger`` (the triggerer's path: allowlist, import, adapter)
all fall due at one moment, 3 s (plus setup time) after they are added, so Airflow's trigger
goes through its own sleep loop. Measured: RSS per waiting trigger, due → all fired, fire lag
p50/p99 and CPU per trigger from adding to the last fire. Loggers at WARNING (Airflow's
DateTimeTrigger logs at INFO once a second per trigger in its last 20 s). Each case runs in
a fresh subprocess; the first load (Airflow's import) is reported apart.

Run: .venv/bin/python -m bench.bench_airflow_triggers   (needs the airflow extra)
     add --case airflow --n 1000 to run one case in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import time
import uuid
from typing import Any

CLASSPATHS = {
    "deferline": ("deferline.engine.triggers.DateTimeTrigger", "deferline.engine.triggers"),
    "airflow": ("airflow.triggers.temporal.DateTimeTrigger", "airflow.triggers"),
}
CASES = [("deferline", 1_000), ("airflow", 1_000), ("deferline", 10_000), ("airflow", 10_000)]


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


async def measure(case: str, n: int) -> dict[str, Any]:
    import gc

    from deferline.engine import TriggerOutcome, TriggerSupervisor, load_trigger

    logging.basicConfig(level=logging.WARNING)
    classpath, prefix = CLASSPATHS[case]
    rss0 = _rss()
    t0 = time.perf_counter()
    load_trigger(classpath, {"moment": dt.datetime.now(dt.UTC)}, allowed_prefixes=[prefix])
    import_s = time.perf_counter() - t0
    gc.collect()
    rss1 = _rss()

    outcomes: list[TriggerOutcome] = []
    done = asyncio.Event()

    def on_event(outcome: TriggerOutcome) -> None:
        outcomes.append(outcome)
        if len(outcomes) == n:
            done.set()

    due = dt.datetime.now(dt.UTC) + dt.timedelta(
        seconds=3.0 + n / (5_000 if case == "deferline" else 500)
    )
    cpu0 = time.process_time()
    async with TriggerSupervisor(capacity=n, on_event=on_event) as sup:
        for _ in range(n):
            trigger = load_trigger(classpath, {"moment": due}, allowed_prefixes=[prefix])
            sup.add(str(uuid.uuid4()), trigger)
        await asyncio.sleep(0.5)
        gc.collect()
        rss2 = _rss()
        assert not outcomes, "setup took longer than the margin"
        await asyncio.wait_for(done.wait(), 60)
        cpu = time.process_time() - cpu0
    assert all(o.status == "fired" for o in outcomes), outcomes[0]
    fired = sorted(o.fired_at for o in outcomes if o.fired_at is not None)
    lags = sorted((at - due).total_seconds() for at in fired)
    return {
        "case": case,
        "n": n,
        "import_s": import_s,
        "import_mb": (rss1 - rss0) / 1e6,
        "bytes_per_trigger": (rss2 - rss1) / n,
        "due_to_all_fired_s": (fired[-1] - due).total_seconds(),
        "lag_p50_ms": _quantile(lags, 0.50) * 1000,
        "lag_p99_ms": _quantile(lags, 0.99) * 1000,
        "cpu_us_per_trigger": cpu / n * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CLASSPATHS))
    parser.add_argument("--n", type=int, default=1_000)
    parser.add_argument("--json", action="store_true", help="print one JSON line (internal)")
    args = parser.parse_args()
    if args.case:
        result = asyncio.run(measure(args.case, args.n))
        print(json.dumps(result) if args.json else result)
        return
    print(f"machine: {os.cpu_count()} cores, Python {platform.python_version()}")
    print()
    print(
        "| N due at once | DateTimeTrigger | first load (import) | bytes / waiting trigger "
        "| due → all fired | lag p50 | lag p99 | CPU / trigger |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case, n in CASES:
        cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--n", str(n), "--json"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(
            f"| {n:,} | {case} | {r['import_s']:.2f} s, {r['import_mb']:.0f} MB "
            f"| {r['bytes_per_trigger']:,.0f} B | {r['due_to_all_fired_s'] * 1000:,.0f} ms "
            f"| {r['lag_p50_ms']:.1f} ms | {r['lag_p99_ms']:.1f} ms "
            f"| {r['cpu_us_per_trigger']:.1f} µs |"
        )


if __name__ == "__main__":
    main()
