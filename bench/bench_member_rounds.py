"""What the group's offsets add to a member producer's round, step by step (Apache Kafka).

A triggerer's round carries the read offsets of its partitions, committed for the group with
its generation (KIP-447): AddPartitionsToTxn, then AddOffsetsToTxn and TxnOffsetCommit (while
the records are produced), then EndTxn. A round without offsets is AddPartitionsToTxn,
Produce, EndTxn. This bench writes one-record rounds through
:class:`~deferline.runners.member.MemberProducer`, one at a time, ``--gap`` ms apart,
alternately a block with the offsets and a block without, and times each round and each of
the producer's requests to the transaction and group coordinators, as the client sees them
(aiokafka sends EndTxn once the round's records are acknowledged: its step includes that
wait). Then, from the broker's request log, the same requests as the broker served them: how
long each took there, and where the slow ones spent it.

``--placed N`` measures instead what a burst's round costs the member's process: rounds of
N fired triggers' records as a triggerer writes them (each its event in its partition of
the resume topic, the event's copy in its task's partition of tasks.events and the tombstone
of its request, 12 partitions each), the CPU and the time of each round. It uses no API
newer than the member producer's first, so another checkout's interpreter can run it
(``--placed`` figures of the build before).

Usage, from this checkout's root::

    .venv/bin/python -m bench.bench_member_rounds [--rounds 500] [--blocks 3] [--gap 5]
    <checkout>/.venv/bin/python -m bench.bench_member_rounds --placed 10000 [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import NewTopic
from aiokafka.producer import sender as aiokafka_sender
from deferline.runners.member import MemberFigures, MemberProducer, Placed
from deferline.runners.testing import group_metadata
from deferline.topics import (
    KRaftBroker,
    Settings,
    make_admin,
    make_consumer,
    partition_for,
    stop_client,
)

from bench._figures import Figure, Peer, Sitting
from bench._harness import machine_line, member_gc_cadence

PARTITIONS = 3
STEPS = {
    "_do_add_partitions_to_txn": "AddPartitionsToTxn",
    "_do_add_offsets_to_txn": "AddOffsetsToTxn",
    "_do_txn_offset_commit": "TxnOffsetCommit",
    "_do_txn_commit": "EndTxn, after the acks",
}
SERVED = ("ADD_PARTITIONS_TO_TXN", "ADD_OFFSETS_TO_TXN", "TXN_OFFSET_COMMIT", "PRODUCE", "END_TXN")
PARTS = ("requestQueueTimeMs", "localTimeMs", "remoteTimeMs", "responseQueueTimeMs")


def _timed(call: Callable[..., Awaitable[Any]], into: list[float]) -> Callable[..., Any]:
    async def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return await call(*args, **kwargs)
        finally:
            into.append((time.perf_counter() - began) * 1000)

    return timed


@contextlib.asynccontextmanager
async def _member(
    bootstrap: str, prefix: str, topics: tuple[str, ...], partitions: int
) -> AsyncIterator[MemberProducer]:
    """The started transactional producer of a member of group ``<prefix>g``: ``topics``
    created with ``partitions`` each, the member assigned the whole of the first."""
    settings = Settings(bootstrap_servers=bootstrap, topic_prefix=prefix)
    admin = make_admin(settings)
    await admin.start()
    await admin.create_topics([NewTopic(f"{prefix}{t}", partitions, 1) for t in topics])
    await admin.close()
    consumer = make_consumer(settings, group_id=f"{prefix}g")
    await consumer.start()
    consumer.subscribe([f"{prefix}{topics[0]}"])
    while len(consumer.assignment()) < partitions:
        await consumer.getmany(timeout_ms=100)
    producer = MemberProducer(
        settings,
        group_id=f"{prefix}g",
        name="bench",
        member=lambda: group_metadata(consumer),
        figures=MemberFigures(),
        transactions=True,
        transaction_timeout=30.0,
    )
    await producer.start()
    try:
        yield producer
    finally:
        await producer.stop()
        await stop_client(consumer, grace=10.0, name="bench consumer")


def _quantile(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(len(sorted_ms) * q))]


def served(request_log: Path) -> None:
    """How the broker served the round's requests: per API, its time there, and where the
    requests over 4 ms spent theirs (queued, working, in purgatory, answer queued)."""
    times: dict[str, list[dict[str, Any]]] = {name: [] for name in SERVED}
    for line in request_log.read_text().splitlines():
        _, _, body = line.partition("Completed request:")
        if body:
            request = json.loads(body)
            name = request["requestHeader"]["requestApiKeyName"]
            if name in times:
                times[name].append(request)
    print("as the broker served them (every block):")
    for name, requests in times.items():
        total = sorted(r["totalTimeMs"] for r in requests)
        if not total:
            continue
        slow = [r for r in requests if r["totalTimeMs"] > 4.0]
        where = ", ".join(
            f"{part[:-6]} {sum(r[part] for r in slow) / len(slow):.1f}" for part in PARTS
        )
        print(
            f"    {name:<22} p50 {_quantile(total, 0.5):5.2f}  p99 {_quantile(total, 0.99):5.2f}"
            f"  max {total[-1]:5.1f} ms  over 4 ms: {len(slow)}/{len(total)}"
            + (f" (mean ms: {where})" if slow else "")
        )


async def bench(
    rounds: int, blocks: int, gap: float, request_log: Path
) -> dict[str, list[tuple[float, float]]]:
    """Per mode ("offsets", "none"), each block's round p50 and p99 in ms."""
    steps: dict[str, list[float]] = {name: [] for name in STEPS.values()}
    for method, name in STEPS.items():  # every producer's requests, timed where they are sent
        if method != "_do_txn_offset_commit":  # the member producer's own, patched per producer
            original = getattr(aiokafka_sender.Sender, method)

            def bound(original: Any = original, name: str = name) -> Any:
                into = steps[name]
                return lambda self, *a, **k: _timed(original, into)(self, *a, **k)

            setattr(aiokafka_sender.Sender, method, bound())
    found: dict[str, list[tuple[float, float]]] = {"offsets": [], "none": []}
    async with (
        KRaftBroker(request_log=request_log) as broker,
        _member(broker.bootstrap, "rounds.", ("in", "out"), PARTITIONS) as producer,
    ):
        for inner in producer._producers:
            sender: Any = inner._sender
            sender._do_txn_offset_commit = _timed(
                sender._do_txn_offset_commit, steps["TxnOffsetCommit"]
            )
        tp = TopicPartition("rounds.in", 0)
        for block in range(blocks):
            for mode in ("offsets", "none"):
                for times in steps.values():
                    times.clear()  # in place: the timers hold these lists
                took = []
                for i in range(rounds):
                    offsets = {tp: block * rounds + i} if mode == "offsets" else {}
                    began = time.perf_counter()
                    await producer.write_placed([("rounds.out", b"k", b"v", 0)], offsets)
                    took.append((time.perf_counter() - began) * 1000)
                    await asyncio.sleep(gap / 1000)
                took.sort()
                p50, p99 = _quantile(took, 0.5), _quantile(took, 0.99)
                found[mode].append((p50, p99))
                print(f"block {block + 1} {mode:<7} round p50 {p50:5.2f} ms  p99 {p99:6.2f} ms")
                for name in STEPS.values():
                    times = sorted(steps[name])
                    if times:
                        slow = sum(t > 4.0 for t in times)
                        print(
                            f"    {name:<19} p50 {_quantile(times, 0.5):5.2f}  "
                            f"p98 {_quantile(times, 0.98):5.2f}  "
                            f"p99 {_quantile(times, 0.99):5.2f}  "
                            f"max {times[-1]:5.1f} ms  over 4 ms: {slow}/{len(times)}"
                        )
    return found


async def placed_rounds(triggers: int, rounds: int) -> tuple[list[float], list[float]]:
    """Per round of ``triggers`` fired triggers' records: its wall and CPU milliseconds."""
    member_gc_cadence()  # as the build's member processes collect
    async with (
        KRaftBroker() as broker,
        _member(broker.bootstrap, "placed.", ("defer", "resume", "events"), 12) as producer,
    ):
        event = b'{"version":1,"kind":"trigger_event","status":"fired","payload":0}' * 5
        offsets = {TopicPartition("placed.defer", p): 1 for p in range(12)}
        walls, cpus = [], []
        for r in range(rounds + 2):  # the first two warm the producers up
            records: list[Placed] = []
            for i in range(triggers):
                key = f"{r}.{i}".encode()
                records.append(("placed.resume", key, event, i % 12))
                records.append(("placed.events", key, event, partition_for(key, 12)))
                records.append(("placed.defer", key, None, i % 12))
            began, cpu = time.perf_counter(), time.process_time()
            await producer.write_placed(records, offsets)
            if r >= 2:
                walls.append((time.perf_counter() - began) * 1000)
                cpus.append((time.process_time() - cpu) * 1000)
    return walls, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500, help="rounds per block")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--gap", type=float, default=5.0, help="ms between rounds")
    parser.add_argument("--placed", type=int, help="fired triggers per round (see above)")
    args = parser.parse_args()
    if args.placed:
        walls, cpus = asyncio.run(placed_rounds(args.placed, args.rounds))
        print(
            f"{args.rounds} rounds of {args.placed:,} fired triggers ({3 * args.placed:,} "
            f"records): CPU per round median {statistics.median(cpus):.1f} ms "
            f"({statistics.median(cpus) / args.placed * 1000:.1f} µs per trigger), wall "
            f"median {statistics.median(walls):.1f} ms"
        )
        return
    sitting = Sitting.begin("member_rounds", broker="kafka")
    print(machine_line())
    with tempfile.TemporaryDirectory() as scratch:
        request_log = Path(scratch) / "requests.log"
        found = asyncio.run(bench(args.rounds, args.blocks, args.gap, request_log))
        served(request_log)

    def shown(mode: str) -> str:
        return ", ".join(f"{p50:.1f} / {p99:.1f}" for p50, p99 in found[mode])

    sitting.write(
        [
            Figure(
                "triggerer.member_round_latency",
                "one-record round of the member producer with the group's offsets "
                "(AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit, EndTxn): p50 / p99",
                shown("offsets"),
                "ms",
                peer=Peer("the same rounds without offsets, same run", shown("none") + " ms"),
                note=f"{args.rounds} rounds per block, {args.gap:g} ms apart, blocks alternated",
            )
        ]
    )


if __name__ == "__main__":
    main()
