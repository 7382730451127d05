"""Memory and time of a triggerer's checkpoint of many new triggers, in-process (no broker).

``--n`` entries of ``--size`` bytes over ``--partitions`` partition tables, each written to
a :class:`RocksCheckpointStore` through ``asyncio.to_thread`` as the lane writes them, then
all deleted again (the tombstones of a burst). Prints what each step added to the RSS. One
measurement per process: the allocator keeps what a step freed, so run it once per figure.
Usage, from this checkout's root::

    .venv/bin/python -m bench.bench_checkpoint [--n 1000000] [--batch-bytes 1048576]

``<other checkout>/.venv/bin/python -m bench.bench_checkpoint`` measures another build.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from deferline.runners.triggerer.testing import ActiveTriggerTable, RocksCheckpointStore

from bench._figures import Figure, Sitting, size_slug
from bench._harness import machine_line, rss_mb


async def run(n: int, size: int, partitions: int, batch_bytes: int | None) -> tuple[float, float]:
    """RSS added (MB) and seconds taken by the checkpoint of ``n`` new entries."""
    tables = []
    for number in range(partitions):
        table = ActiveTriggerTable()
        for i in range(n // partitions):
            table.apply(f"{number}-{i:032d}".encode(), os.urandom(size), offset=i)
        tables.append(table)
    with tempfile.TemporaryDirectory() as state:
        # (a build from before the batches takes no batch_bytes: one batch per partition)
        store = (
            RocksCheckpointStore(state)
            if batch_bytes is None
            else RocksCheckpointStore(state, batch_bytes=batch_bytes)
        )
        base, started = rss_mb(os.getpid()), time.monotonic()
        for number, table in enumerate(tables):
            await asyncio.to_thread(store.write, "defer", number, table.take_changes())
        written, took = rss_mb(os.getpid()), time.monotonic() - started
        print(f"checkpoint of {n:,} new entries: +{written - base:,.0f} MB RSS, {took:.1f} s")
        started = time.monotonic()
        for number, table in enumerate(tables):
            for key in list(table):
                table.apply(key, None, offset=n)
            await asyncio.to_thread(store.write, "defer", number, table.take_changes())
        took, after = time.monotonic() - started, rss_mb(os.getpid())
        print(f"checkpoint deleting them: {after - base:+,.0f} MB RSS in all, {took:.1f} s")
        store.close()
    return written - base, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=700, help="bytes per stored request")
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--batch-bytes", type=int, default=None, help="the store's default")
    args = parser.parse_args()
    sitting = Sitting.begin("checkpoint")
    print(machine_line())
    print(f"{args.partitions} partitions, entries of {args.size} bytes, batch {args.batch_bytes}")
    added, took = asyncio.run(run(args.n, args.size, args.partitions, args.batch_bytes))
    sitting.write(
        [
            Figure(
                f"checkpoint.triggerer_{size_slug(args.n)}",
                f"triggerer checkpoint of {args.n:,} new entries ({args.size} B each), in "
                "process: RSS added",
                round(added),
                "MB",
                note=f"{took:.1f} s",
            )
        ]
    )


if __name__ == "__main__":
    main()
