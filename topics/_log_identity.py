"""Reading a :class:`LogIdentity` from the broker: cluster id, topic ids, partition counts.

aiokafka (0.14) asks for Metadata up to v5, which has the cluster id but no topic ids; topic
ids came with Metadata v10 (Kafka 2.8). This module adds that version's request and response
(flexible encoding, UUID fields) and sends it where the broker has it, falling back to v4/v5
(topic ids None) where it has not. Apache Kafka gives a random cluster id per cluster and a
topic id per topic incarnation. Tansu (0.6) gives a topic id per topic (a UUIDv7) but one
cluster id for every Tansu (``tansu_cluster`` unless started with ``--cluster-id``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from io import BytesIO
from typing import Any, TypeAlias

from aiokafka.errors import KafkaError, for_code
from aiokafka.protocol.abstract import AbstractType
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.metadata import MetadataRequest_v4, MetadataRequest_v5
from aiokafka.protocol.types import (
    Boolean,
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Schema,
    TaggedFields,
)

from ._errors import BrokerError
from ._identity import LogIdentity, TopicIdentity

__all__ = ["read_log_identity"]

_NO_ID = bytes(16)  # Kafka's "no topic id"


class _Uuid(AbstractType[bytes]):  # type: ignore[misc]  # aiokafka is untyped here
    @classmethod
    def encode(cls, value: bytes) -> bytes:
        return value

    @classmethod
    def decode(cls, data: BytesIO) -> bytes:
        value = data.read(16)
        if len(value) != 16:
            raise ValueError("Buffer underrun decoding a UUID")
        return value


class _MetadataResponse_v10(Response):  # type: ignore[misc]  # aiokafka is untyped here
    API_KEY = 3
    API_VERSION = 10
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "brokers",
            CompactArray(
                ("node_id", Int32),
                ("host", CompactString("utf-8")),
                ("port", Int32),
                ("rack", CompactString("utf-8")),
                ("tags", TaggedFields),
            ),
        ),
        ("cluster_id", CompactString("utf-8")),
        ("controller_id", Int32),
        (
            "topics",
            CompactArray(
                ("error_code", Int16),
                ("topic", CompactString("utf-8")),
                ("topic_id", _Uuid),
                ("is_internal", Boolean),
                (
                    "partitions",
                    CompactArray(
                        ("error_code", Int16),
                        ("partition", Int32),
                        ("leader", Int32),
                        ("leader_epoch", Int32),
                        ("replicas", CompactArray(Int32)),
                        ("isr", CompactArray(Int32)),
                        ("offline_replicas", CompactArray(Int32)),
                        ("tags", TaggedFields),
                    ),
                ),
                ("topic_authorized_operations", Int32),
                ("tags", TaggedFields),
            ),
        ),
        ("cluster_authorized_operations", Int32),
        ("tags", TaggedFields),
    )


class _MetadataRequest_v10(RequestStruct):  # type: ignore[misc]  # aiokafka is untyped here
    FLEXIBLE_VERSION = True
    API_KEY = 3
    API_VERSION = 10
    RESPONSE_TYPE = _MetadataResponse_v10
    SCHEMA = Schema(
        (
            "topics",
            CompactArray(
                ("topic_id", _Uuid), ("name", CompactString("utf-8")), ("tags", TaggedFields)
            ),
        ),
        ("allow_auto_topic_creation", Boolean),
        ("include_cluster_authorized_operations", Boolean),
        ("include_topic_authorized_operations", Boolean),
        ("tags", TaggedFields),
    )


_Struct: TypeAlias = MetadataRequest_v4 | MetadataRequest_v5 | _MetadataRequest_v10


class _IdentityRequest(Request[_Struct]):  # type: ignore[misc]  # aiokafka is untyped here
    """Metadata of named topics, never auto-creating them; v10 where the broker has it."""

    API_KEY = 3

    def __init__(self, topics: Sequence[str]) -> None:
        self._topics = list(topics)

    def build(self, request_struct_class: type[_Struct]) -> _Struct:
        if request_struct_class is _MetadataRequest_v10:
            topics: list[tuple[bytes, str, dict[int, bytes]]] = [
                (_NO_ID, name, {}) for name in self._topics
            ]
            return _MetadataRequest_v10(topics, False, False, False, {})
        return request_struct_class(self._topics, False)


async def read_log_identity(
    client: Any, topics: Sequence[str], *, prefix: str, group: str
) -> LogIdentity:
    """The identity of ``topics`` as the cluster behind ``client`` (a started aiokafka
    client, e.g. a consumer's ``_client``) names them now. BrokerError if a topic is missing."""
    try:
        response = await client.send(client.get_random_node(), _IdentityRequest(topics))
    except KafkaError as exc:
        raise BrokerError(f"cannot read the metadata of {', '.join(topics)}: {exc}") from exc
    answer = response.to_object()
    found = {t["topic"]: t for t in answer["topics"]}
    identities = []
    for name in sorted(topics):
        topic = found.get(name)
        code = topic["error_code"] if topic is not None else -1
        if topic is None or code != 0:
            error = for_code(code).__name__ if topic is not None else "not in the answer"
            raise BrokerError(f"cannot read the identity of topic {name}: {error}")
        raw = topic.get("topic_id", _NO_ID)
        identities.append(
            TopicIdentity(
                name=name,
                topic_id=None if raw == _NO_ID else str(uuid.UUID(bytes=raw)),
                partitions=len(topic["partitions"]),
            )
        )
    return LogIdentity(
        cluster_id=answer["cluster_id"], topics=tuple(identities), prefix=prefix, group=group
    )
