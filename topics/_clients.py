"""aiokafka client factories: one Settings object gives every client the same connection."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any, TypeAlias

from aiokafka import AIOKafkaClient, AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.conn import create_conn
from aiokafka.errors import IllegalStateError, KafkaConnectionError, KafkaError
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.transaction import InitProducerIdRequest

from ._errors import AccessError, BrokerError, access_error
from ._partitioner import Murmur2Partitioner
from ._settings import Settings

logger = logging.getLogger(__name__)

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


def principal_of(settings: Settings) -> str | None:
    """The principal the brokers will see for SASL settings (``User:<name>``), else None."""
    if settings.security_protocol.startswith("SASL_") and settings.sasl_username:
        return f"User:{settings.sasl_username}"
    return None


async def probe_access(settings: Settings, *, timeout_s: float = 10.0) -> AccessError | None:
    """Connect to each bootstrap broker once, as a client would, and return the
    AuthenticationError a refused handshake or login amounts to (None if none was refused).

    aiokafka reports a failed bootstrap only as "Unable to bootstrap"; this recovers the
    broker's reason (SASL authentication failed, certificate verify failed...).
    """
    kwargs = connection_kwargs(settings)
    kwargs.pop("bootstrap_servers")
    for address in settings.bootstrap_servers.split(","):
        host, _, port = address.strip().rpartition(":")
        if not host or not port.isdigit():
            continue
        try:
            async with asyncio.timeout(timeout_s):
                conn = await create_conn(host.strip("[]"), int(port), **kwargs)
        except (KafkaError, OSError, TimeoutError) as exc:
            mapped = access_error(exc, principal=principal_of(settings))
            if mapped is not None:
                return mapped
            continue
        conn.close()
    return None


async def supports_idempotence(settings: Settings) -> bool:
    """Whether the brokers hand out producer ids, as idempotent producers need.

    Asks for one (InitProducerId, no transactional id), as an idempotent producer does at
    start. Apache Kafka grants it (to a principal with Write on some topic); the embedded
    Tansu broker advertises the request but refuses it, so this is False there. Use it to
    decide ``Settings.enable_idempotence`` when the backend is not known in advance.
    """
    kwargs = connection_kwargs(settings)
    client = AIOKafkaClient(**kwargs)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30.0
    try:
        await client.bootstrap()
        while True:
            request = InitProducerIdRequest(None, 60_000)
            response = await client.send(client.get_random_node(), request)
            code: int = response.to_object()["error_code"]
            # A fresh cluster is still loading its transaction coordinator: ask again.
            if code not in _COORDINATOR_NOT_READY or loop.time() >= deadline:
                return code == 0
            await asyncio.sleep(0.2)
    except KafkaError as exc:
        mapped = access_error(exc, principal=principal_of(settings))
        if mapped is not None:
            raise mapped from exc
        return False
    finally:
        await client.close()


_COORDINATOR_NOT_READY = frozenset({14, 15, 16})  # load in progress, not available, not coordinator


def is_bootstrap_failure(exc: BaseException) -> bool:
    """True when ``exc`` or one of its causes is aiokafka's bare bootstrap failure."""
    current: BaseException | None = exc
    for _ in range(10):
        if current is None:
            return False
        if isinstance(current, KafkaConnectionError):
            return True
        current = current.__cause__ or current.__context__
    return False


def make_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    """A producer (not started) using Kafka's murmur2 partitioner; ``acks="all"``, small linger.

    Idempotent when ``settings.enable_idempotence`` (off by default because the embedded Tansu
    broker lacks it; turn it on against Apache Kafka).
    """
    kwargs = {
        **connection_kwargs(settings),
        **PRODUCER_DEFAULTS,
        **({"enable_idempotence": True} if settings.enable_idempotence else {}),
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


async def known_position(
    consumer: AIOKafkaConsumer, tp: TopicPartition, *, within: float = 0.1
) -> int | None:
    """The consumer's position of ``tp`` (past any transaction markers it has read over), or
    None when it has none within ``within`` seconds (not assigned, its offset being looked
    up): a caller holding a lock does not wait for an offset lookup."""
    try:
        return await asyncio.wait_for(consumer.position(tp), within)
    except (KafkaError, IllegalStateError, TimeoutError):
        return None


Client: TypeAlias = AIOKafkaConsumer | AIOKafkaProducer | AIOKafkaAdminClient


async def start_client(client: Client, *, grace: float, name: str = "client") -> None:
    """Start an aiokafka client; a start that fails or is cancelled closes what it opened.

    aiokafka's bootstrap keeps its first connection in a local while it asks the broker for
    metadata: a start cancelled there leaks that connection, out of reach of any stop. So a
    cancellation does not cut the start: it waits for it (at most ``grace`` seconds), closes
    the client and is re-raised. A start that raises closes the client too.
    """
    starting = asyncio.ensure_future(client.start())
    try:
        await asyncio.shield(starting)
    except asyncio.CancelledError:
        try:
            await asyncio.wait([starting], timeout=grace)
        finally:
            if not starting.done():
                starting.cancel()
            elif not starting.cancelled():
                starting.exception()  # retrieved: the caller's cancellation wins
            await close_client(client, grace=grace, name=name)
        raise
    except BaseException:
        await close_client(client, grace=grace, name=name)
        raise


async def close_client(client: Client, *, grace: float, name: str = "client") -> bool:
    """Stop a consumer or producer (:func:`stop_client`) or close an admin client, closing
    its connections whatever happens. Returns True when the client's own close completed."""
    if not isinstance(client, AIOKafkaAdminClient):
        return await stop_client(client, grace=grace, name=name)
    try:
        await asyncio.wait_for(client.close(), grace)
        return True
    except TimeoutError:
        logger.warning("%s did not close in time; closing its connections", name)
    except KafkaError as exc:
        logger.warning("%s close failed; closing its connections", name, extra={"error": repr(exc)})
    await _close_connections(client, grace)
    return False


async def stop_client(
    client: AIOKafkaConsumer | AIOKafkaProducer, *, grace: float, name: str = "client"
) -> bool:
    """Stop an aiokafka consumer or producer, and close its connections whatever happens.

    aiokafka's ``stop()`` can end half way: the consumer's fetcher cancels a fetch that is
    sleeping in its retry backoff (after a broker error: a SASL re-login refused, a broker
    gone) and lets that task's CancelledError out of ``stop()``, before the connections are
    closed; a ``stop()`` cut by ``grace`` (seconds) stops at the same place. Either way the
    connections are closed here, so nothing leaks; only a cancellation of the caller itself
    is re-raised. Returns True when ``stop()`` completed.
    """
    current = asyncio.current_task()
    try:
        await asyncio.wait_for(client.stop(), grace)
        return True
    except TimeoutError:
        logger.warning("%s did not stop in time; closing its connections", name)
    except asyncio.CancelledError:
        if current is not None and current.cancelling():
            await _close_connections(client, grace)
            raise
        logger.warning("%s stopped without reaching the broker; closing its connections", name)
    except KafkaError as exc:
        logger.warning("%s stop failed; closing its connections", name, extra={"error": repr(exc)})
    await _close_connections(client, grace)
    return False


async def _close_connections(client: Client, grace: float) -> None:
    kafka: AIOKafkaClient | None = getattr(client, "_client", None) or getattr(
        client, "client", None
    )
    if kafka is None:
        return
    try:
        # The sockets close at once; waiting for the transports is bounded.
        await asyncio.wait_for(kafka.close(), grace)
    except (TimeoutError, KafkaError, OSError) as exc:
        logger.warning("closing connections failed", extra={"error": repr(exc)})


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
