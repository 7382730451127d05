"""KafkaMessageTrigger against a real broker, run by the trigger supervisor."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

import orjson
import pytest
from aiokafka.admin import NewTopic
from deferline.engine import TriggerOutcome, TriggerSupervisor
from deferline.engine.triggers import KafkaMessageTrigger
from deferline.topics import Settings

from tests._until import until
from tests.integration._util import KafkaClients

pytestmark = pytest.mark.integration


async def _topic(settings: Settings, kafka_clients: KafkaClients, partitions: int = 3) -> str:
    name = f"{settings.topic_prefix}orders"
    admin = await kafka_clients.admin()
    await admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    return name


@pytest.mark.brokers_differ(
    "Tansu ignores the time of an offsets-for-times lookup; the per-record check must hold"
)
async def test_fires_on_the_first_matching_message_since_it_was_created(
    settings: Settings, kafka_clients: KafkaClients
) -> None:
    topic = await _topic(settings, kafka_clients)
    producer = await kafka_clients.producer()

    async def send(key: str, value: dict[str, object]) -> None:
        await producer.send_and_wait(topic, orjson.dumps(value), key=key.encode())

    await send("o-1", {"order": 1, "state": "paid"})  # before the trigger exists: ignored
    await asyncio.sleep(0.01)  # a later millisecond for the next message timestamps
    trigger = KafkaMessageTrigger(
        topic,
        {"state": "paid"},
        bootstrap_servers=settings.bootstrap_servers,
        consumer_config={"fetch_max_wait_ms": 20},
        poll_timeout=0.05,
    )
    await send("o-2", {"order": 2, "state": "new"})
    # Produced after the trigger was created but before it runs: still seen.
    await send("o-3", {"order": 3, "state": "paid", "amount": 12.5})

    outcomes: list[TriggerOutcome] = []
    async with TriggerSupervisor(capacity=5, on_event=outcomes.append) as sup:
        sup.add("kafka", trigger)
        await until(lambda: outcomes, within=30, interval=0.05)
        assert "kafka" not in sup or outcomes[0].final
    out = outcomes[0]
    assert out.status == "fired"
    assert out.payload["value"] == {"order": 3, "state": "paid", "amount": 12.5}
    assert out.payload["key"] == "o-3"
    assert out.payload["topic"] == topic
    assert isinstance(out.payload["timestamp"], dt.datetime)


@pytest.mark.tansu_first
async def test_waits_for_a_message_that_arrives_later(
    settings: Settings, kafka_clients: KafkaClients, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="deferline.engine.triggers._kafka")
    topic = await _topic(settings, kafka_clients, partitions=2)
    producer = await kafka_clients.producer()
    trigger = KafkaMessageTrigger(
        topic,
        key="job-9",
        value_regex=r"\bDONE\b",
        since="latest",
        bootstrap_servers=settings.bootstrap_servers,
        consumer_config={"fetch_max_wait_ms": 20},
        poll_timeout=0.05,
    )
    outcomes: list[TriggerOutcome] = []
    async with TriggerSupervisor(capacity=5, on_event=outcomes.append) as sup:
        sup.add("later", trigger)
        await until(
            lambda: any("reading" in r.getMessage() for r in caplog.records),
            within=30,
            interval=0.05,
        )  # the trigger is assigned and positioned at the end: nothing matched yet
        assert outcomes == []
        await producer.send_and_wait(topic, b"job-9 RUNNING", key=b"job-9")
        await producer.send_and_wait(topic, b"job-8 DONE", key=b"job-8")
        await producer.send_and_wait(topic, b"job-9 DONE", key=b"job-9")
        await until(lambda: outcomes, within=30, interval=0.05)
    assert outcomes[0].payload["value"] == "job-9 DONE"
