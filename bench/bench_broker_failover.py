"""A broker dies while timers fall due: three Apache Kafka nodes, one SIGKILLed, then restarted.

N tasks are deferred on DateTimeTriggers due across a window of W seconds; a triggerer and
a scheduler run in this process. A quarter into the window the node leading most of the
test's partitions is SIGKILLed; it is restarted half-way through. Topics have replication
factor 3 and ``min.insync.replicas=2``; producers use ``acks=all`` and are idempotent.

Reported: due → event lag (event seen on the resume topic) and due → resume lag (RunTask
seen on queue.resumes), over all timers and over those due while the node was down; the
longest gap with no event at all; and the counts that must be exact: every trigger fired,
every task resumed exactly once, nothing left deferred.

Run: .venv/bin/python -m bench.bench_broker_failover [--n 20000] [--window 20]
(starts its own three-node cluster from the cached Kafka jars; about two minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from deferline.topics import KRaftCluster

from bench._figures import Figure, Sitting
from tests.integration._failover import run_failover


@contextlib.asynccontextmanager
async def _cluster() -> AsyncIterator[KRaftCluster]:
    async with KRaftCluster(heap="448m") as cluster:
        yield cluster


async def main(n: int, window: float) -> None:
    sitting = Sitting.begin("broker_failover", broker="kafka")
    began = time.perf_counter()
    async with _cluster() as cluster:
        print(f"three-node cluster up in {time.perf_counter() - began:.1f}s: {cluster.bootstrap}")
        results = {}
        # Back to back on the same cluster: the control run (nothing killed), then the failover.
        for label, kill in (("no failure", False), ("node SIGKILLed", True)):
            with tempfile.TemporaryDirectory() as state:
                result = await run_failover(
                    cluster, n=n, window=window, state_dir=Path(state), kill=kill
                )
            results[label] = result.summary()
            if result.event_lag:
                results[label]["event_lag_mean_s"] = round(statistics.fmean(result.event_lag), 3)
    keys = list(results["node SIGKILLed"])
    print(f"{'':>30}  " + "  ".join(f"{label:>16}" for label in results))
    for key in keys:
        print(f"{key:>30}  " + "  ".join(f"{r.get(key)!s:>16}" for r in results.values()))
    killed, control = results["node SIGKILLed"], results["no failure"]
    sitting.write(
        [
            Figure(
                "failover.broker_leader_sigkill",
                f"three Kafka nodes, the leader of most partitions SIGKILLed, {n:,} timers due "
                f"over {window:.0f} s: longest gap without an event",
                killed["longest_event_gap_s"],
                "s",
                note=f"event lag max {killed['event_lag_max_s']} s "
                f"({control['event_lag_max_s']} s with nothing killed); resumed "
                f"{killed['resumed_tasks']:,}, {killed['duplicate_resumes']} twice, "
                f"{killed['still_deferred']} left deferred",
            )
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--window", type=float, default=20.0)
    args = parser.parse_args()
    asyncio.run(main(args.n, args.window))
