"""Stopping a client always completes and closes its connections, even after broker errors."""

import asyncio
import logging
import uuid

import pytest
from deferline.topics import Settings, TansuBroker, make_consumer, make_producer, stop_client

from tests.integration._util import wait_until

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
        await wait_until(
            lambda: "Failed fetch messages" in caplog.text,
            30,
            message="a fetch failed and sleeps in its retry backoff",
        )
    completed = await stop_client(consumer, grace=5.0)
    assert completed is False, "stop() was cut short by the fetcher's CancelledError"
    assert consumer._client._sync_task is None, "the client's connections were closed"
    assert all(not conn.connected() for conn in consumer._client._conns.values())
    await asyncio.gather(fetching, return_exceptions=True)  # woken by the stop
