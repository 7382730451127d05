"""Which broker-side fetch wait a triggerer uses: long poll where the broker allows it.

Apache Kafka answers a waiting fetch as soon as a record arrives, so a long wait costs no
latency and spares an idle member dozens of empty fetches a second. The embedded Tansu
broker holds every fetch for its whole wait, so there the wait is the latency floor and
must stay short. The two are told apart by their ApiVersions answer: Apache Kafka (since
0.11) serves OffsetForLeaderEpoch, Tansu does not.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaClient
from aiokafka.errors import KafkaError
from aiokafka.protocol.admin import ApiVersionRequest
from deferline.topics import Settings
from deferline.topics._clients import connection_kwargs

__all__ = ["LONG_POLL_MS", "SHORT_WAIT_MS", "answers_fetches_early", "choose_fetch_wait"]

logger = logging.getLogger(__name__)

LONG_POLL_MS = 500
"""Fetch wait on brokers that answer a waiting fetch as soon as data arrives (Kafka)."""

SHORT_WAIT_MS = 20
"""Fetch wait on brokers that hold every fetch for the whole wait (Tansu), and when unsure."""

_OFFSET_FOR_LEADER_EPOCH = 23


async def answers_fetches_early(settings: Settings, *, timeout_s: float = 10.0) -> bool:
    """Whether the brokers answer a waiting fetch as soon as a record arrives.

    True when their ApiVersions answer lists OffsetForLeaderEpoch (Apache Kafka since 0.11);
    False for Tansu, and when the brokers cannot be asked (the short wait is always safe).
    """
    client = AIOKafkaClient(**connection_kwargs(settings))
    try:
        async with asyncio.timeout(timeout_s):
            await client.bootstrap()
            return await _asks_early(client)
    except (KafkaError, OSError, TimeoutError) as exc:
        logger.warning("cannot ask the brokers' API versions", extra={"error": repr(exc)})
        return False
    finally:
        await client.close()


async def _asks_early(client: AIOKafkaClient) -> bool:
    response = await client.send(client.get_random_node(), ApiVersionRequest())
    return any(key == _OFFSET_FOR_LEADER_EPOCH for key, _, _ in response.api_versions)


async def choose_fetch_wait(
    settings: Settings, configured: int | None, *, client: AIOKafkaClient | None = None
) -> int:
    """``configured`` when given, else :data:`LONG_POLL_MS` or :data:`SHORT_WAIT_MS`.

    ``client``: an already bootstrapped client (a started producer's) to ask on its open
    connection, one round trip, instead of connecting anew.
    """
    if configured is not None:
        return configured
    if client is None:
        early = await answers_fetches_early(settings)
    else:
        try:
            async with asyncio.timeout(10.0):
                early = await _asks_early(client)
        except (KafkaError, OSError, TimeoutError) as exc:
            logger.warning("cannot ask the brokers' API versions", extra={"error": repr(exc)})
            early = False
    return LONG_POLL_MS if early else SHORT_WAIT_MS
