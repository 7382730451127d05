"""Helpers for tests against a real broker: clients that get closed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from deferline.runners.testing import client_of
from deferline.topics import Settings, make_admin, make_consumer, make_producer

from tests._until import until


class KafkaClients:
    """Makes started aiokafka clients from a Settings and stops them all in ``aclose()``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stops: list[Callable[[], Awaitable[Any]]] = []

    async def producer(self, **overrides: Any) -> AIOKafkaProducer:
        producer = make_producer(self.settings, **overrides)
        self._stops.append(producer.stop)
        await producer.start()
        return producer

    async def consumer(
        self, *topics: str, group_id: str | None = None, **overrides: Any
    ) -> AIOKafkaConsumer:
        consumer = make_consumer(self.settings, *topics, group_id=group_id, **overrides)
        self._stops.append(consumer.stop)
        await consumer.start()
        return consumer

    async def member(
        self, topic: str, group_id: str, partitions: int, **overrides: Any
    ) -> AIOKafkaConsumer:
        """A consumer of ``group_id`` subscribed to the new ``topic``, once assigned all its
        ``partitions``. It joins only once its metadata has every partition: a member that
        joined knowing fewer would wait for its next metadata refresh (minutes) to join
        again."""
        consumer = await self.consumer(group_id=group_id, **overrides)

        async def known() -> bool:
            await client_of(consumer).force_metadata_update()
            return len(consumer.partitions_for_topic(topic) or ()) == partitions

        await until(known, within=30, what=f"the {partitions} partitions of {topic}")
        consumer.subscribe([topic])

        async def assigned() -> bool:
            await consumer.getmany(timeout_ms=100)
            return len(consumer.assignment()) == partitions

        await until(assigned, within=60, what="the member's assignment")
        return consumer

    async def admin(self, **overrides: Any) -> AIOKafkaAdminClient:
        admin = make_admin(self.settings, **overrides)
        self._stops.append(admin.close)
        await admin.start()
        return admin

    async def aclose(self) -> None:
        """Stop every client made here, newest first, even if some stops fail."""
        errors: list[BaseException] = []
        while self._stops:
            stop = self._stops.pop()
            try:
                await stop()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
