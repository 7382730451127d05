"""aiokafka client factories: one Settings object gives every client the same connection."""

from __future__ import annotations

import ssl
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.helpers import create_ssl_context

from ._errors import BrokerError
from ._partitioner import Murmur2Partitioner
from ._settings import Settings

# Low-latency defaults: a trigger event should reach the scheduler in milliseconds. Tansu
# holds a fetch until fetch_max_wait_ms even when data is there, so that must stay small.
PRODUCER_DEFAULTS: dict[str, Any] = {"acks": "all", "linger_ms": 2}
CONSUMER_DEFAULTS: dict[str, Any] = {
    "fetch_max_wait_ms": 20,
    "enable_auto_commit": False,
    "auto_offset_reset": "earliest",
    # The scheduler writes in transactions on Apache Kafka: never act on an aborted write.
    "isolation_level": "read_committed",
}


def connection_kwargs(settings: Settings) -> dict[str, Any]:
    """bootstrap, client id and security keyword arguments shared by all aiokafka clients."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": settings.bootstrap_servers,
        "client_id": settings.client_id,
        "security_protocol": settings.security_protocol,
    }
    if settings.security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = _ssl_context(settings)
    if settings.security_protocol.startswith("SASL_"):
        kwargs["sasl_mechanism"] = settings.sasl_mechanism
        kwargs["sasl_plain_username"] = settings.sasl_username
        kwargs["sasl_plain_password"] = settings.sasl_password
    return kwargs


def make_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    """A producer (not started) using Kafka's murmur2 partitioner; ``acks="all"``, small linger.

    Idempotence stays off by default because the embedded Tansu broker lacks it; pass
    ``enable_idempotence=True`` on Apache Kafka.
    """
    kwargs = {
        **connection_kwargs(settings),
        **PRODUCER_DEFAULTS,
        "partitioner": Murmur2Partitioner(),
        **overrides,
    }
    return AIOKafkaProducer(**kwargs)


def make_consumer(
    settings: Settings, *topics: str, group_id: str | None = None, **overrides: Any
) -> AIOKafkaConsumer:
    """A consumer (not started): manual commits, earliest reset, short fetch wait."""
    kwargs = {**connection_kwargs(settings), **CONSUMER_DEFAULTS, "group_id": group_id}
    return AIOKafkaConsumer(*topics, **{**kwargs, **overrides})


def make_admin(settings: Settings, **overrides: Any) -> AIOKafkaAdminClient:
    """An admin client (not started)."""
    return AIOKafkaAdminClient(**{**connection_kwargs(settings), **overrides})


def _ssl_context(settings: Settings) -> ssl.SSLContext:
    try:
        context: ssl.SSLContext = create_ssl_context(
            cafile=settings.ssl_cafile,
            certfile=settings.ssl_certfile,
            keyfile=settings.ssl_keyfile,
        )
    except (OSError, ssl.SSLError) as exc:
        raise BrokerError(
            f"cannot load TLS files (cafile={settings.ssl_cafile!r}, "
            f"certfile={settings.ssl_certfile!r}, keyfile={settings.ssl_keyfile!r}): {exc}"
        ) from exc
    return context
