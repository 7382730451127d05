"""Shared harness of the benchmarks: cases in fresh subprocesses, a local broker, process figures.

An engine benchmark module gives ``measure(case, n)`` (a coroutine returning one dict of
figures) and ``report(run)``, which prints its table, calling ``run(case, n)`` for each case
it wants, and returns the figures it printed. ``main()`` turns that into the command line: with
``--case`` it measures in this process and prints one JSON line; without, it prints the
machine line and the table, each case measured in a subprocess of its own so one case cannot
inflate the next, and records the figures (bench/_figures.py).

The broker benchmarks share :func:`local_broker` (a broker for the run, or one already
running) and the per-process figures :func:`cpu_seconds`, :func:`rss_mb`, :func:`peak_rss_mb`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer
from deferline.topics import partition_for

from bench._figures import Figure, Sitting

Figures = dict[str, Any]
RunCase = Callable[[str, int], Figures]


def member_gc_cadence() -> None:
    """Collect as a ``deferline triggerer`` or ``scheduler`` process of the build under test
    does (builds before the cadence was importable: every 50,000 allocations, as they did)."""
    try:
        from deferline.runners.testing import collect_less_often
    except ImportError:
        gc.set_threshold(50_000, 20, 100)
    else:
        collect_less_often()


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


@contextlib.asynccontextmanager
async def local_broker(backend: str = "tansu", bootstrap: str | None = None) -> AsyncIterator[str]:
    """Yield ``bootstrap`` when given, else start a broker for the run and yield its address.

    ``backend``: ``tansu`` (embedded) or ``kafka`` (Apache Kafka from its jars); the broker
    is stopped when the block ends.
    """
    async with local_broker_process(backend, bootstrap) as (address, _):
        yield address


@contextlib.asynccontextmanager
async def local_broker_process(
    backend: str = "tansu", bootstrap: str | None = None
) -> AsyncIterator[tuple[str, int | None]]:
    """:func:`local_broker`, yielding the address and the broker's process id (None for a
    broker given by ``bootstrap``, which the bench did not start)."""
    if bootstrap:
        yield bootstrap, None
        return
    from deferline.topics import KRaftBroker, TansuBroker

    broker: TansuBroker | KRaftBroker = TansuBroker() if backend == "tansu" else KRaftBroker()
    async with broker:
        # An older build's broker (a before/after run imports it) has no ``pid``.
        yield broker.bootstrap, getattr(broker, "pid", None)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds used so far by process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` now, in MiB."""
    return _status_mb(pid, "VmRSS:")


def peak_rss_mb(pid: int) -> float:
    """Peak resident set size of process ``pid`` so far, in MiB."""
    return _status_mb(pid, "VmHWM:")


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return 0.0


def main(
    *,
    cases: Sequence[str],
    measure: Callable[[str, int], Coroutine[Any, Any, Figures]],
    report: Callable[[RunCase], Sequence[Figure]],
) -> None:
    """Command line of the benchmark module that defines ``measure`` (see its docstring)."""
    caller = sys.modules[measure.__module__]
    module = caller.__spec__.name if caller.__spec__ is not None else measure.__module__
    doc = caller.__doc__ or module
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--case", choices=list(cases))
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--json", action="store_true", help="print one JSON line (internal)")
    args = parser.parse_args()
    if args.case:
        result = asyncio.run(measure(args.case, args.n))
        print(json.dumps(result) if args.json else result)
        return
    sitting = Sitting.begin(module.rsplit(".", 1)[-1].removeprefix("bench_"))
    print(machine_line())
    print()
    sitting.write(report(lambda case, n: run_case_in_subprocess(module, case, n)))


# -- triggerer benchmarks (bench_triggerer, bench_rebalance): producing many requests fast --


def record_batches(
    producer: AIOKafkaProducer, records: Sequence[tuple[bytes, bytes]], parts: int
) -> list[tuple[int, Any]]:
    """``records`` as producer batches, in order per partition, for :func:`send_batches`.

    Built ahead, so a timed send spends the machine's CPU on sending, not on the bench's
    own partitioning (murmur2 in Python) and batch building.
    """
    by_partition: dict[int, list[tuple[bytes, bytes]]] = {}
    for key, value in records:
        by_partition.setdefault(partition_for(key, parts), []).append((key, value))
    batches: list[tuple[int, Any]] = []
    for partition, rows in by_partition.items():
        batch = producer.create_batch()
        for key, value in rows:
            if batch.append(key=key, value=value, timestamp=None) is None:
                batches.append((partition, batch))
                batch = producer.create_batch()
                batch.append(key=key, value=value, timestamp=None)
        batches.append((partition, batch))
    return batches


async def send_batches(
    producer: AIOKafkaProducer, topic: str, batches: list[tuple[int, Any]]
) -> None:
    """Send :func:`record_batches` and wait until all are acknowledged."""
    futures = [await producer.send_batch(batch, topic, partition=p) for p, batch in batches]
    await asyncio.gather(*futures)


async def produce_batched(
    producer: AIOKafkaProducer, topic: str, records: Sequence[tuple[bytes, bytes]], parts: int
) -> None:
    """Produce in order per partition, one producer batch per send (fast for millions)."""
    await send_batches(producer, topic, record_batches(producer, records, parts))
