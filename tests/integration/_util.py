"""Helpers for tests against a real broker: polling with a deadline, clients that get closed."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from deferline.topics import Settings, make_admin, make_consumer, make_producer


async def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 10.0,  # noqa: ASYNC109 - a polling deadline, not an I/O timeout
    interval: float = 0.05,
    *,
    message: str | None = None,
) -> Any:
    """Poll ``predicate`` (sync or async) until it returns something truthy; return that.

    Raises AssertionError naming the condition when ``timeout`` seconds pass first.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if loop.time() >= deadline:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(f"condition not met within {timeout:.1f}s: {what}")
        await asyncio.sleep(interval)


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
