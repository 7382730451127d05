"""Helpers for tests against a real broker: clients that get closed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from deferline.topics import Settings, make_admin, make_consumer, make_producer


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
