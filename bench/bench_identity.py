"""What checking a checkpoint's log identity adds to a scheduler start or a partition rebuild.

Two costs, each beside the work it is added to:

- ``read_log_identity`` (one Metadata v10 request for the defer and resume topics) against
  aiokafka's own Metadata request (v5) for the same topics, which every client sends;
- ``match_identity`` of a :class:`RocksCheckpointStore` over ``--partitions`` partitions with
  checkpoints of ``--n`` entries in all, against ``load`` of the same partitions (what a
  rebuild does right after it).

Usage, from this checkout's root::

    .venv/bin/python -m bench.bench_identity [--backend tansu|kafka] [--rounds 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

from aiokafka.protocol.metadata import MetadataRequest
from deferline.runners.triggerer.testing import ActiveTriggerTable, RocksCheckpointStore
from deferline.topics import (
    LogIdentity,
    Settings,
    TopicIdentity,
    TopicNames,
    ensure_topics,
    make_consumer,
    read_log_identity,
    stop_client,
    topic_specs,
)

from bench._figures import Figure, Peer, Sitting
from bench._harness import local_broker, machine_line


async def _median_ms(call: Callable[[], Awaitable[object]], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        await call()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


async def bench_reads(backend: str, rounds: int) -> list[tuple[float, float]]:
    """Median ms of the identity read and of aiokafka's Metadata v5, two interleaved rounds."""
    medians = []
    async with local_broker(backend) as bootstrap:
        settings = Settings(bootstrap_servers=bootstrap, topic_prefix="bench.", partitions=12)
        await ensure_topics(settings, topic_specs(settings))
        names = TopicNames(settings.topic_prefix)
        topics = [names.defer(), names.resume()]
        consumer = make_consumer(settings, group_id=None)
        await consumer.start()
        try:
            client = consumer._client

            async def identity() -> object:
                return await read_log_identity(client, topics, prefix="bench.", group="g")

            async def metadata_v5() -> object:
                node = client.get_random_node()
                return await client.send(node, MetadataRequest(topics, False))

            for _ in range(2):  # interleaved: the same noise for both
                v10 = await _median_ms(identity, rounds)
                v5 = await _median_ms(metadata_v5, rounds)
                medians.append((v10, v5))
                print(
                    f"{backend:<6} read_log_identity (Metadata v10) {v10:6.3f} ms   "
                    f"aiokafka Metadata v5 {v5:6.3f} ms   ratio {v10 / v5:4.2f}"
                )
        finally:
            await stop_client(consumer, grace=10.0, name="bench consumer")
    return medians


async def bench_match(n: int, partitions: int, rounds: int) -> None:
    settings = Settings(bootstrap_servers="unused:1", topic_prefix="bench.")
    topic = TopicNames(settings.topic_prefix).defer()
    log = LogIdentity("c", (TopicIdentity(topic, "id", partitions),), "bench.", "g")
    with tempfile.TemporaryDirectory() as state:
        store = RocksCheckpointStore(state)
        store.match_identity(topic, range(partitions), log)
        for number in range(partitions):
            table = ActiveTriggerTable()
            for i in range(n // partitions):
                table.apply(f"{number}-{i:032d}".encode(), b"x" * 200, offset=i)
            store.write(topic, number, table.take_changes())

        async def match() -> None:
            store.match_identity(topic, range(partitions), log)

        async def load() -> object:
            return [store.load(topic, p) for p in range(partitions)]

        for _ in range(2):
            matched = await _median_ms(match, rounds)
            loaded = await _median_ms(load, max(1, rounds // 20))
            print(
                f"match_identity over {partitions} partitions {matched:7.3f} ms   "
                f"load of them ({n} entries) {loaded:8.3f} ms   ratio {matched / loaded:6.4f}"
            )
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("tansu", "kafka"), default="tansu")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=12)
    args = parser.parse_args()
    sitting = Sitting.begin("identity", broker=args.backend)
    print(machine_line())
    reads = asyncio.run(bench_reads(args.backend, args.rounds))
    asyncio.run(bench_match(args.n, args.partitions, args.rounds))
    sitting.write(
        [
            Figure(
                "restart.identity_check",
                "the identity check before a restore (Metadata v10: cluster id, topic ids, "
                "partition counts), per scheduler start or partition rebuild",
                " / ".join(f"{v10:.2f}" for v10, _ in reads),
                "ms",
                peer=Peer(
                    "aiokafka's Metadata v5, same run",
                    " / ".join(f"{v5:.2f}" for _, v5 in reads) + " ms",
                ),
                note=f"median of {args.rounds} reads, two interleaved rounds",
            )
        ]
    )


if __name__ == "__main__":
    main()
