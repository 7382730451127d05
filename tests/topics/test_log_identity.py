"""The Metadata request behind read_log_identity, without a broker: the version it picks and
what it makes of an answer with topic ids, with the "no id" UUID, and without ids at all."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from aiokafka.protocol.metadata import MetadataRequest_v5
from deferline.topics import BrokerError, TopicIdentity, read_log_identity
from deferline.topics.testing import IdentityRequest, MetadataRequest_v10

TOPIC_ID = uuid.UUID("0193e0a4-0000-7000-8000-00000000000d")


def test_v10_where_the_broker_has_it_and_never_auto_creating() -> None:
    v10 = IdentityRequest(["p.defer"]).prepare({3: (0, 12)})
    assert isinstance(v10, MetadataRequest_v10)
    assert v10.to_object()["allow_auto_topic_creation"] is False
    v5 = IdentityRequest(["p.defer"]).prepare({3: (0, 7)})
    assert isinstance(v5, MetadataRequest_v5)
    assert v5.to_object()["allow_auto_topic_creation"] is False


def test_a_v10_answer_decodes_with_its_topic_ids() -> None:
    response = MetadataRequest_v10.RESPONSE_TYPE(
        0,
        [(1, "localhost", 9092, None, {})],
        "cluster-x",
        1,
        [
            (0, "p.defer", TOPIC_ID.bytes, False, [(0, 0, 1, 0, [1], [1], [], {})], 0, {}),
            (0, "p.resume", bytes(16), False, [(0, 0, 1, 0, [1], [1], [], {})], 0, {}),
        ],
        0,
        {},
    )
    decoded = MetadataRequest_v10.RESPONSE_TYPE.decode(response.encode())
    identity = _read(decoded, ["p.resume", "p.defer"])
    assert identity.cluster_id == "cluster-x"
    assert identity.topics == (
        TopicIdentity("p.defer", str(TOPIC_ID), 1),
        TopicIdentity("p.resume", None, 1),  # Kafka's "no id" UUID: no id
    )


def test_an_answer_without_topic_ids_still_names_the_cluster_and_partitions() -> None:
    answer = _Answer({"cluster_id": "c", "topics": [_topic("p.tasks", 3)]})
    identity = _read(answer, ["p.tasks"])
    assert identity.cluster_id == "c"
    assert identity.topics == (TopicIdentity("p.tasks", None, 3),)


def test_a_missing_topic_is_a_broker_error() -> None:
    answer = _Answer({"cluster_id": "c", "topics": [{**_topic("p.tasks", 0), "error_code": 3}]})
    with pytest.raises(BrokerError, match=r"p\.tasks: UnknownTopicOrPartitionError"):
        _read(answer, ["p.tasks"])


class _Answer:
    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj = obj

    def to_object(self) -> dict[str, Any]:
        return self.obj


def _topic(name: str, partitions: int) -> dict[str, Any]:
    return {"error_code": 0, "topic": name, "partitions": [{}] * partitions}


class _Client:
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def get_random_node(self) -> int:
        return 1

    async def send(self, node: int, request: Any) -> Any:
        return self.answer


def _read(answer: Any, topics: list[str]) -> Any:
    return asyncio.run(read_log_identity(_Client(answer), topics, prefix="p.", group="g"))
