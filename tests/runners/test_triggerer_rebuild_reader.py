"""The rebuild's reading fails loudly when the group cannot say its committed offset.

Taking 0 for it would dead-letter every old keyless record of the partition again. No
broker: the reader and the group consumer are fakes that answer what the reading asks.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from deferline.runners.triggerer.testing import (
    Checkpointer,
    LaneOptions,
    MemoryCheckpointStore,
    OwnedPartition,
    RebuildReader,
    TriggererMetrics,
)


class MetadataAnswer:
    """The broker's Metadata answer: one partition of each topic, no topic ids."""

    def to_object(self) -> dict[str, Any]:
        return {
            "cluster_id": "c",
            "topics": [
                {"error_code": 0, "topic": name, "partitions": [{}]}
                for name in ("p.defer", "p.resume")
            ],
        }


class Client:
    async def set_topics(self, topics: list[str]) -> None:
        pass

    def get_random_node(self) -> int:
        return 1

    async def send(self, node: int, request: Any) -> Any:
        return MetadataAnswer()


class EmptyTopics:
    """A rebuild reader over empty partitions: every offset is 0, every fetch empty."""

    def __init__(self) -> None:
        self._client = Client()

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, 0)

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, 0)

    def assign(self, tps: list[TopicPartition]) -> None:
        pass

    def seek(self, tp: TopicPartition, offset: int) -> None:
        pass

    def highwater(self, tp: TopicPartition) -> int:
        return 0


class NoCoordinator:
    """A group consumer whose committed-offset request fails."""

    async def committed(self, tp: TopicPartition) -> int:
        raise KafkaError("coordinator unavailable")


async def test_a_committed_offset_that_cannot_be_read_fails_the_rebuild() -> None:
    metrics = TriggererMetrics()

    def log(part: int | None = None, **fields: Any) -> dict[str, Any]:
        return {"partition": part, **fields}

    reading = RebuildReader(
        defer_topic="p.defer",
        resume_topic="p.resume",
        options=LaneOptions(member="m"),
        checkpointer=Checkpointer(
            MemoryCheckpointStore(), topic="p.defer", max_age=3600.0, metrics=metrics, log=log
        ),
        prefix="p.",
        group="p.triggerer",
        log=log,
    )
    part = OwnedPartition(
        number=0, defer_tp=TopicPartition("p.defer", 0), resume_tp=TopicPartition("p.resume", 0)
    )

    with pytest.raises(KafkaError, match="coordinator unavailable"):
        await reading.read(
            cast(AIOKafkaConsumer, NoCoordinator()), cast(AIOKafkaConsumer, EmptyTopics()), [part]
        )
