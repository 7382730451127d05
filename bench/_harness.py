"""Shared harness of the engine benchmarks: each case runs in a fresh subprocess.

A benchmark module gives ``measure(case, n)`` (a coroutine returning one dict of figures)
and ``report(run)``, which prints its table, calling ``run(case, n)`` for each case it wants.
``main()`` turns that into the command line: with ``--case`` it measures in this process and
prints one JSON line; without, it prints the machine line and the table, each case measured
in a subprocess of its own so one case cannot inflate the next.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from deferline.topics import partition_for

Figures = dict[str, Any]
RunCase = Callable[[str, int], Figures]


def machine_line() -> str:
    """One line naming the machine, for the top of every table."""
    cores, python = os.cpu_count(), platform.python_version()
    return f"machine: {cores} cores, Python {python}, {platform.machine()}"


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of already sorted values (nearest rank)."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run_case_in_subprocess(module: str, case: str, n: int) -> Figures:
    """Run ``python -m <module> --case <case> --n <n> --json`` and return its figures."""
    cmd = [sys.executable, "-m", module, "--case", case, "--n", str(n), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result: Figures = json.loads(out.strip().splitlines()[-1])
    return result


def main(
    *,
    module: str,
    doc: str,
    cases: Sequence[str],
    measure: Callable[[str, int], Coroutine[Any, Any, Figures]],
    report: Callable[[RunCase], None],
) -> None:
    """Command line of one benchmark module (see the module docstring)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--case", choices=list(cases))
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--json", action="store_true", help="print one JSON line (internal)")
    args = parser.parse_args()
    if args.case:
        result = asyncio.run(measure(args.case, args.n))
        print(json.dumps(result) if args.json else result)
        return
    print(machine_line())
    print()
    report(lambda case, n: run_case_in_subprocess(module, case, n))


# -- triggerer benchmarks (bench_triggerer, bench_rebalance): producing many requests fast --


async def produce_batched(
    producer: AIOKafkaProducer, topic: str, records: Sequence[tuple[bytes, bytes]], parts: int
) -> None:
    """Produce in order per partition, one producer batch per send (fast for millions)."""
    by_partition: dict[int, list[tuple[bytes, bytes]]] = {}
    for key, value in records:
        by_partition.setdefault(partition_for(key, parts), []).append((key, value))
    futures = []
    for partition, rows in by_partition.items():
        batch = producer.create_batch()
        for key, value in rows:
            if batch.append(key=key, value=value, timestamp=None) is None:
                futures.append(await producer.send_batch(batch, topic, partition=partition))
                batch = producer.create_batch()
                batch.append(key=key, value=value, timestamp=None)
        futures.append(await producer.send_batch(batch, topic, partition=partition))
    await asyncio.gather(*futures)
