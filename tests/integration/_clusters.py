"""Test helpers: a second, fresh broker of the backend under test (another cluster); deleting
a topic; the end offsets of one."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from aiokafka import TopicPartition
from deferline.topics import (
    KRaftBroker,
    Settings,
    TansuBroker,
    make_admin,
    make_consumer,
    stop_client,
)

from tests._until import until


@contextlib.asynccontextmanager
async def another_cluster(backend: str, settings: Settings) -> AsyncIterator[Settings]:
    """``settings`` (same topic prefix, so the same topic names) on a new broker of
    ``backend``, stopped on exit."""
    if backend not in ("tansu", "kafka"):
        pytest.skip(f"the test starts a second {backend} broker itself: tansu or kafka only")
    broker: TansuBroker | KRaftBroker = (
        TansuBroker() if backend == "tansu" else KRaftBroker(heap="384m")
    )
    async with broker:
        yield settings.model_copy(update={"bootstrap_servers": broker.bootstrap})


async def delete_topic(settings: Settings, topic: str) -> None:
    """Delete ``topic`` and wait until the cluster no longer lists it."""
    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.delete_topics([topic])

        async def gone() -> bool:
            return topic not in await admin.list_topics()

        await until(gone, within=30, interval=0.05, what=f"{topic} is deleted")
    finally:
        await admin.close()


async def end_offsets(settings: Settings, topic: str) -> dict[int, int]:
    """The end offset of each partition of ``topic``: the listed end raised to the high
    watermark of a fetch (Tansu lists the base offset of the last batch plus one)."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        listed = await consumer.end_offsets(tps)
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, listed[tp])

        async def fetched() -> bool:
            await consumer.getmany(timeout_ms=50)
            return all(consumer.highwater(tp) is not None for tp in tps)

        await until(
            fetched, within=30, interval=0.05, what=f"a fetch of every partition of {topic}"
        )
        return {tp.partition: max(listed[tp], int(consumer.highwater(tp))) for tp in tps}
    finally:
        await stop_client(consumer, grace=10.0, name="test consumer")
