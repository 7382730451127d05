"""What a trigger's log line costs its triggerer with ``--trigger-logs`` (no broker).

    python -m bench.bench_trigger_logs [--n 100000] [--runs 3]

One trigger in a TriggerSupervisor logs ``--n`` lines (``self.log.info`` with one argument)
and fires; CPU per line with no handler on the root logger (what a line costs anyway), with
the triggerer's capture under its bound (each line kept: formatted, masked, queued), and past
its bound (each line dropped and counted).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from deferline.engine import BaseTrigger, TriggerEvent, TriggerSupervisor
from deferline.runners.triggerer.testing import TriggerLogCapture

from bench._figures import Peer, Sitting, runs_figure, size_slug


class Loud(BaseTrigger):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "bench.bench_trigger_logs.Loud", {"n": self.n}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        log = self.log
        for i in range(self.n):
            log.info("line %d of a loud trigger", i)
        yield TriggerEvent(self.n)


async def cpu_per_line(n: int, capture: TriggerLogCapture | None) -> float:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    root.handlers[:] = [capture] if capture is not None else []
    root.setLevel(logging.INFO)
    fired = asyncio.Event()
    try:
        async with TriggerSupervisor(
            capacity=2, on_event=lambda _: fired.set(), block_threshold=None
        ) as supervisor:
            start = time.process_time()
            supervisor.add("loud", Loud(n))
            await fired.wait()
            return (time.process_time() - start) / n * 1e6
    finally:
        root.handlers[:], root.level = saved, level


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sitting = Sitting.begin("trigger_logs")

    def nothing() -> None:
        return None

    cases: dict[str, Callable[[], TriggerLogCapture | None]] = {
        "none": lambda: None,
        "kept": lambda: TriggerLogCapture(bound=10 * args.n, on_drop=nothing),
        "dropped": lambda: TriggerLogCapture(bound=0, on_drop=nothing),
    }
    found: dict[str, list[float]] = {}
    for name, make in cases.items():
        found[name] = [round(await cpu_per_line(args.n, make()), 2) for _ in range(args.runs)]
        median = sorted(found[name])[len(found[name]) // 2]
        print(f"{name}: {median:.2f} µs CPU per line {found[name]}")
    slug = size_slug(args.n)
    plain = sorted(found["none"])[len(found["none"]) // 2]
    sitting.write(
        [
            runs_figure(
                f"trigger_logs.line_kept_{slug}",
                "a trigger's log line with --trigger-logs, kept (formatted, masked, queued)",
                found["kept"],
                "µs CPU",
                peer=Peer("the same line with no handler", plain),
            ),
            runs_figure(
                f"trigger_logs.line_dropped_{slug}",
                "a trigger's log line with --trigger-logs, past the bound (dropped, counted)",
                found["dropped"],
                "µs CPU",
                peer=Peer("the same line with no handler", plain),
            ),
        ]
    )


if __name__ == "__main__":
    asyncio.run(main())
