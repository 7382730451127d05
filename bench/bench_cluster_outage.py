"""The whole cluster goes away while N timers fall due, and comes back: how long until every
task is resumed, and what the processes spent while no broker answered.

One single-node Apache Kafka of its own; a triggerer, a scheduler, a worker and a console as
processes (tests/integration/_outage.py). N tasks are deferred on timers due across W
seconds; one second before the first falls due the only broker is SIGKILLed (started again
on its data after D seconds) or SIGSTOPped (SIGCONTed after D seconds), so every timer falls
due while no broker answers. Beside them, in the same sitting, the control run: the same
timeline with nothing lost.

Reported per run: from the broker answering again (control: from the last timer due) to the
last task's first resume RunTask; every task resumed exactly once; each process's CPU
seconds while the broker was away (a lost cluster must not spin a core); the outage lines.

Run: .venv/bin/python -m bench.bench_cluster_outage [--n 10000] [--window 5] [--down 30]
(about six minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Literal

from bench._figures import Figure, Sitting
from tests.integration._outage import OutageResult, run_outage


async def _run(
    how: Literal["kill", "stop", "none"], n: int, window: float, down: float
) -> OutageResult:
    with tempfile.TemporaryDirectory(prefix="bench-outage-") as workdir:
        return await run_outage(
            Path(workdir), how=how, n=n, window=window, outage=down, lost_after=-1.0
        )


async def main(n: int, window: float, down: float) -> None:
    sitting = Sitting.begin("cluster_outage", broker="kafka")
    runs = {
        "nothing lost": await _run("none", n, window, down),
        "broker SIGKILLed": await _run("kill", n, window, down),
        "broker SIGSTOPped": await _run("stop", n, window, down),
    }
    print(f"{n} timers due over {window:.0f} s; outage {down:.0f} s (kill: plus the restart)")
    print(f"{'':>36}" + "".join(f"{label:>20}" for label in runs))
    rows: dict[str, list[str]] = {
        "cluster away (s)": [
            f"{r.down_s:.1f}" if label != "nothing lost" else "-" for label, r in runs.items()
        ],
        "back -> last resume (s)": [f"{r.back_to_last_resume_s:.2f}" for r in runs.values()],
        "resumed / duplicates": [
            f"{r.resumed_tasks} / {r.duplicate_resumes}" for r in runs.values()
        ],
    }
    for process in ("triggerer", "scheduler", "worker", "console"):
        rows[f"{process} CPU while away (s)"] = [
            f"{r.cpu_while_down_s.get(process, 0.0):.2f}" if label != "nothing lost" else "-"
            for label, r in runs.items()
        ]
    rows["processes exited"] = [
        str(sum(code is not None for code in r.exit_codes.values())) for r in runs.values()
    ]
    for key, values in rows.items():
        print(f"{key:>36}" + "".join(f"{v:>20}" for v in values))
    for label, result in runs.items():
        for process, lines in result.logs.items():
            for line in lines:
                print(f"  [{label}] {process}: {line[:110]}")
    control = runs["nothing lost"]
    sitting.write(
        Figure(
            f"failover.cluster_lost_{how}",
            f"the whole cluster lost (its one Apache Kafka node {what} for {down:.0f} s), "
            f"{n:,} timers due while it is away: broker back → last task resumed",
            round(r.back_to_last_resume_s, 2),
            "s",
            note=f"resumed {r.resumed_tasks:,}, {r.duplicate_resumes} twice; processes exited: "
            f"{sum(code is not None for code in r.exit_codes.values())}; nothing lost, same "
            f"sitting: last due → last resumed {control.back_to_last_resume_s:.2f} s",
        )
        for how, what, r in (
            ("sigkill", "SIGKILLed and started again on its data", runs["broker SIGKILLed"]),
            ("sigstop", "SIGSTOPped", runs["broker SIGSTOPped"]),
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--down", type=float, default=30.0)
    args = parser.parse_args()
    asyncio.run(main(args.n, args.window, args.down))
