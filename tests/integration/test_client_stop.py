"""Stopping a client always completes and closes its connections, even after broker errors."""

import asyncio
import contextlib
import gc
import logging
import uuid
import warnings

import pytest
from deferline.topics import (
    Settings,
    TansuBroker,
    close_client,
    make_admin,
    make_consumer,
    make_producer,
    start_client,
    stop_client,
)

from tests._until import until

pytestmark = pytest.mark.integration


async def test_a_consumer_stopped_while_its_fetch_backs_off_stops_and_closes_everything(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """aiokafka's fetcher sleeps after a failed fetch; stopping the consumer then lets that
    sleep's CancelledError out of ``stop()`` before the connections are closed (as when a
    SASL re-login is refused under a running triggerer). ``stop_client`` finishes the job
    and does not raise."""
    caplog.set_level(logging.ERROR, logger="aiokafka")
    topic = f"stop-{uuid.uuid4().hex[:8]}"
    async with TansuBroker() as broker:
        settings = Settings(bootstrap_servers=broker.bootstrap)
        producer = make_producer(settings)
        await producer.start()
        await producer.send_and_wait(topic, b"x", key=b"k")
        await stop_client(producer, grace=5.0)
        consumer = make_consumer(settings, group_id=f"g-{topic}", retry_backoff_ms=60_000)
        await consumer.start()
        consumer.subscribe([topic])
        assert await consumer.getmany(timeout_ms=10_000)
        fetching = asyncio.create_task(consumer.getmany(timeout_ms=60_000))
        await broker.stop()
        await until(
            lambda: "Failed fetch messages" in caplog.text,
            within=30,
            interval=0.05,
            what="a fetch failed and sleeps in its retry backoff",
        )
    completed = await stop_client(consumer, grace=5.0)
    assert completed is False, "stop() was cut short by the fetcher's CancelledError"
    assert consumer._client._sync_task is None, "the client's connections were closed"
    assert all(not conn.connected() for conn in consumer._client._conns.values())
    await asyncio.gather(fetching, return_exceptions=True)  # woken by the stop


@pytest.mark.tansu_first
@pytest.mark.parametrize("kind", ["consumer", "producer", "admin"])
async def test_a_start_cancelled_at_any_moment_leaves_no_connection_open(
    settings: Settings, kind: str
) -> None:
    """aiokafka's bootstrap holds its first connection in a local while it asks for metadata:
    a start cancelled there leaks it, out of reach of any stop (as when a console or a replay
    is stopped while it connects). ``start_client`` lets a cancelled start end, then closes
    the client. Cancelled after 0, 1, 2, ... loop turns, every moment of a start is hit."""
    make = {"consumer": make_consumer, "producer": make_producer, "admin": make_admin}[kind]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for turns in range(40):
            client = make(settings) if kind != "consumer" else make(settings, group_id=None)
            starting = asyncio.create_task(start_client(client, grace=5.0, name=kind))
            for _ in range(turns):
                await asyncio.sleep(0)
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            # Closed by its owner, as ever (a client never started warns too); a connection
            # leaked by the start is out of its reach.
            await close_client(client, grace=5.0, name=kind)
        gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
