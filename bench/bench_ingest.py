"""CPU per DeferRequest on a triggerer's live tail, in-process (no broker, no other process).

The lane's ``apply_live`` (table, decode, trigger built, supervisor ``add``) over N
requests as a worker writes them (a ``DateTimeTrigger`` and a resume target), with the
decode alone beside it. Quiet and repeatable where the live bench
(``bench.bench_triggerer --only throughput``) shares the machine with a broker and a
producer: compare two builds as a ratio in one sitting. Usage, from this checkout's root::

    .venv/bin/python -m bench.bench_ingest [--n 30000] [--repeat 5]

``<other checkout>/.venv/bin/python -m bench.bench_ingest`` measures another build with
the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from aiokafka import TopicPartition
from deferline.engine import TriggerSupervisor
from deferline.runners.triggerer.testing import (
    LaneOptions,
    MemoryCheckpointStore,
    OwnedPartition,
    TriggererMetrics,
    TriggerLane,
)
from deferline.schemas import decode
from deferline.topics import Settings

from bench._figures import Figure, Peer, Sitting
from bench._harness import member_gc_cadence
from bench.bench_triggerer import cheap_requests


class Record(NamedTuple):
    """The fields of an aiokafka ConsumerRecord that the lane reads."""

    offset: int
    key: bytes
    value: bytes
    timestamp: int


def best_us(run: Callable[[], object], n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        run()
        best = min(best, time.process_time() - started)
    return best / n * 1e6


async def apply_live_us(records: list[Record], repeat: int) -> float:
    """Best CPU µs per record of ``apply_live`` over ``records`` (a fresh lane each time)."""
    best = float("inf")
    for _ in range(repeat):
        supervisor = TriggerSupervisor(
            capacity=10 * len(records), on_event=lambda outcome: None, block_threshold=None
        )
        await supervisor.start()
        emitter: Any = None  # nothing is emitted: every trigger waits an hour
        lane = TriggerLane(
            Settings(bootstrap_servers="unused:9092"),
            queue=None,
            options=LaneOptions(member="bench"),
            supervisor=supervisor,
            emitter=emitter,
            store=MemoryCheckpointStore(),
            metrics=TriggererMetrics(),
            cipher=None,
            cancel=lambda trigger_id, kill=False: None,
            on_fatal=lambda exc: None,
            task_partitions=12,
        )
        part = OwnedPartition(0, TopicPartition("defer", 0), TopicPartition("resume", 0))
        started = time.process_time()
        for start in range(0, len(records), 2000):  # the lane's max_poll_records
            lane._dispatcher.apply_live(part, records[start : start + 2000])
        best = min(best, time.process_time() - started)
        await supervisor.stop()
    return best / len(records) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=30_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    sitting = Sitting.begin("ingest")
    member_gc_cadence()  # as the build's member processes collect
    due = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    pairs = cheap_requests(args.n, due, "ingest")
    records = [Record(i, key, value, 0) for i, (key, value) in enumerate(pairs)]
    values = [value for _, value in pairs]
    print(f"{args.n:,} DeferRequests of {len(values[0])} bytes, best of {args.repeat}")
    decode_us = best_us(lambda: [decode(v) for v in values], args.n, args.repeat)
    print(f"decode (the DeferRequest model): {decode_us:.2f} µs")
    figures = []
    try:
        from deferline.schemas import decode_deferral
    except ImportError:
        pass  # a build without the triggerer's own read
    else:
        quick_us = best_us(lambda: [decode_deferral(v) for v in values], args.n, args.repeat)
        print(f"decode_deferral (the triggerer's read): {quick_us:.2f} µs")
        figures.append(
            Figure(
                "ingest.decode_deferral",
                f"the triggerer's read of a worker's DeferRequest ({len(values[0])} B): "
                f"`decode_deferral`, {args.n:,} results kept alive",
                round(quick_us, 2),
                "µs",
                peer=Peer("`decode` (the DeferRequest model), same run", round(decode_us, 2)),
            )
        )
    apply_us = asyncio.run(apply_live_us(records, args.repeat))
    print(f"apply_live, whole: {apply_us:.2f} µs per DeferRequest ({1e6 / apply_us:,.0f}/s)")
    figures.append(
        Figure(
            "ingest.apply_live",
            "deferrals in, in process: `_apply_live` CPU per DeferRequest",
            round(apply_us, 2),
            "µs",
            note=f"{1e6 / apply_us:,.0f}/s",
        )
    )
    sitting.write(figures)


if __name__ == "__main__":
    main()
