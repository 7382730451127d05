"""Kafka clients side by side: aiokafka (what deferline uses) against librdkafka (confluent-kafka).

The triggerer's Kafka path per trigger is one DeferRequest read and one event written (plus
its tombstone); the scheduler's is one event read and two records written. This script
measures only that client work, on the same records, the same topic layout and the same
broker, with no deferline logic around it:

- **produce**: N event-sized records (a trigger id key, a 400-byte JSON value) to a
  12-partition topic, ``acks=all``, idempotent, Kafka's murmur2 partitioning. aiokafka as
  the triggerer's emitter sends them (one record batch per partition and send), and as a
  plain ``send()`` per record; confluent-kafka with ``produce()`` per record and delivery
  callbacks, polled as it goes, flushed at the end.
- **consume**: the same N records read back from the beginning without a group
  (``read_committed``), touching each key and value: aiokafka ``getmany``, confluent-kafka
  ``consume(num_messages=...)``.

Reported: records/s and CPU per record of this process (all its threads: librdkafka works in
its own threads). confluent-kafka is not a dependency of deferline:

    .venv/bin/pip install confluent-kafka
    .venv/bin/python -m bench.bench_clients --backend kafka --n 200000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.topics import Settings, TopicSpec, ensure_topics, make_consumer, make_producer

from bench._figures import Figure, Peer, Sitting
from bench._harness import local_broker, produce_batched

PARTITIONS = 12
VALUE = b'{"version":1,"kind":"trigger_event",' + b'"x":"' + b"e" * 360 + b'"}'


def records(n: int) -> list[tuple[bytes, bytes]]:
    return [(uuid.uuid5(uuid.NAMESPACE_OID, str(i)).hex.encode(), VALUE) for i in range(n)]


# What measure() printed, in order: (label, records/s, µs of CPU per record).
MEASURED: list[tuple[str, float, float]] = []
# The printed rows recorded: label, claim id, what it is, its peer's label.
CLAIMS = (
    (
        "aiokafka produce, record batches",
        "clients.aiokafka_produce_batches",
        "aiokafka, produce as the emitter does (one record batch per partition)",
        "confluent-kafka produce, produce() per record",
    ),
    (
        "aiokafka produce, send() per record",
        "clients.aiokafka_send",
        "aiokafka, `send()` per record",
        "confluent-kafka produce, produce() per record",
    ),
    (
        "aiokafka consume, getmany",
        "clients.aiokafka_consume",
        "aiokafka, consume (`getmany`)",
        "confluent-kafka consume, consume()",
    ),
)


def measure(label: str, n: int, began: tuple[float, float]) -> None:
    wall, cpu = time.perf_counter() - began[0], time.process_time() - began[1]
    MEASURED.append((label, n / wall, cpu / n * 1e6))
    print(
        f"{label:<44} {n / wall:>10,.0f} records/s  {cpu / n * 1e6:6.1f} µs CPU per record",
        flush=True,
    )


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


async def topic(settings: Settings, name: str) -> str:
    await ensure_topics(
        settings, [TopicSpec(name=name, partitions=PARTITIONS, replication_factor=1)]
    )
    return name


async def aiokafka_batches(settings: Settings, rows: list[tuple[bytes, bytes]]) -> str:
    name = await topic(settings, f"bench.clients.{uuid.uuid4().hex[:8]}")
    producer = make_producer(settings, linger_ms=1, max_batch_size=256 * 1024)
    await producer.start()
    try:
        began = now()
        for start in range(0, len(rows), 10_000):  # the emitter hands over bounded chunks
            await produce_batched(producer, name, rows[start : start + 10_000], PARTITIONS)
        measure("aiokafka produce, record batches", len(rows), began)
    finally:
        await producer.stop()
    return name


async def aiokafka_sends(settings: Settings, rows: list[tuple[bytes, bytes]]) -> None:
    name = await topic(settings, f"bench.clients.{uuid.uuid4().hex[:8]}")
    producer = make_producer(settings, linger_ms=1, max_batch_size=256 * 1024)
    await producer.start()
    try:
        began = now()
        for start in range(0, len(rows), 10_000):
            futures = [
                await producer.send(name, value, key=key)
                for key, value in rows[start : start + 10_000]
            ]
            await asyncio.gather(*futures)
        measure("aiokafka produce, send() per record", len(rows), began)
    finally:
        await producer.stop()


async def aiokafka_consume(settings: Settings, name: str, n: int) -> None:
    consumer: AIOKafkaConsumer = make_consumer(
        settings, group_id=None, max_poll_records=None, fetch_max_wait_ms=500
    )
    await consumer.start()
    try:
        tps = [TopicPartition(name, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        seen = size = 0
        began = now()
        while seen < n:
            batches = await consumer.getmany(timeout_ms=1000, max_records=10_000)
            for messages in batches.values():
                for message in messages:
                    size += len(message.key or b"") + len(message.value or b"")
                seen += len(messages)
        measure("aiokafka consume, getmany", seen, began)
    finally:
        await consumer.stop()


def librdkafka_config(settings: Settings) -> dict[str, Any]:
    return {"bootstrap.servers": settings.bootstrap_servers}


def librdkafka_produce(settings: Settings, name: str, rows: Sequence[tuple[bytes, bytes]]) -> None:
    from confluent_kafka import Producer

    producer = Producer(
        {
            **librdkafka_config(settings),
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 1,
            "partitioner": "murmur2_random",  # Kafka's Java partitioner, as deferline's
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    acked = 0

    def delivered(error: Any, message: Any) -> None:
        nonlocal acked
        if error is not None:
            raise RuntimeError(f"delivery failed: {error}")
        acked += 1

    began = now()
    for i, (key, value) in enumerate(rows):
        producer.produce(name, value, key, on_delivery=delivered)
        if i % 1000 == 0:
            producer.poll(0)
    producer.flush(60)
    if acked != len(rows):
        raise RuntimeError(f"{acked} of {len(rows)} acknowledged")
    measure("confluent-kafka produce, produce() per record", len(rows), began)


def librdkafka_consume(settings: Settings, name: str, n: int) -> None:
    from confluent_kafka import OFFSET_BEGINNING, Consumer
    from confluent_kafka import TopicPartition as RdTopicPartition

    consumer = Consumer(
        {
            **librdkafka_config(settings),
            "group.id": f"bench-{uuid.uuid4().hex[:6]}",  # required; nothing is committed
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "fetch.wait.max.ms": 500,
        }
    )
    try:
        consumer.assign([RdTopicPartition(name, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        seen = size = 0
        began = now()
        while seen < n:
            for message in consumer.consume(num_messages=10_000, timeout=1.0):
                if message.error() is not None:
                    continue
                size += len(message.key() or b"") + len(message.value() or b"")
                seen += 1
        measure("confluent-kafka consume, consume()", seen, began)
    finally:
        consumer.close()


async def run(bootstrap: str, n: int) -> None:
    settings = Settings(bootstrap_servers=bootstrap, partitions=PARTITIONS)
    rows = records(n)
    print(f"{n:,} records of {len(rows[0][0]) + len(VALUE)} bytes, {PARTITIONS} partitions")
    name = await aiokafka_batches(settings, rows)
    await aiokafka_sends(settings, rows)
    await aiokafka_consume(settings, name, n)
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        print("confluent-kafka is not installed: `.venv/bin/pip install confluent-kafka`")
        return
    rd_topic = await topic(settings, f"bench.clients.{uuid.uuid4().hex[:8]}")
    blocking: list[Callable[[], None]] = [
        lambda: librdkafka_produce(settings, rd_topic, rows),
        lambda: librdkafka_consume(settings, rd_topic, n),
        lambda: librdkafka_consume(settings, name, n),  # what aiokafka wrote, read back
    ]
    for step in blocking:
        step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["tansu", "kafka"], default="kafka")
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args()
    sitting = Sitting.begin("clients", broker=args.backend)

    async def go() -> None:
        bootstrap = os.environ.get("DEFERLINE_BENCH_BOOTSTRAP")
        async with local_broker(args.backend, bootstrap) as address:
            await run(address, args.n)

    asyncio.run(go())
    first = {label: (rate, cpu) for label, rate, cpu in reversed(MEASURED)}
    figures = []
    for label, claim, what, peer_label in CLAIMS:
        if label not in first:
            continue
        rate, cpu = first[label]
        peer = first.get(peer_label)
        figures.append(
            Figure(
                claim,
                f"{what}, {args.n:,} records of {len(VALUE) + 32} B",
                round(rate),
                "records/s",
                peer=None
                if peer is None
                else Peer(
                    f"{peer_label} (librdkafka), same run", f"{peer[0]:,.0f}/s, {peer[1]:.1f} µs"
                ),
                note=f"{cpu:.1f} µs CPU each",
            )
        )
    sitting.write(figures)


if __name__ == "__main__":
    main()
