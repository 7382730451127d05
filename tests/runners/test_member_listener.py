"""The member core's rebalance listener: what it hands a role's partition processor."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.runners.member import MemberFigures, MemberListener, StickyAssignor

TOPIC = "deferline.defer"


class _Processor:
    """Records what it is told; its quiesce never ends when ``stuck``."""

    def __init__(self, *, stuck: bool = False) -> None:
        self.stuck = stuck
        self.calls: list[tuple[str, Any]] = []
        self.cancelled = False

    async def quiesce(self, partitions: frozenset[int]) -> None:
        self.calls.append(("quiesce", partitions))
        if self.stuck:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise

    def quiesce_cut_short(self, partitions: frozenset[int]) -> None:
        self.calls.append(("cut short", partitions))

    async def rejoined(self, member_id: str) -> None:
        self.calls.append(("rejoined", member_id))

    async def assign(self, generation: int, partitions: frozenset[int]) -> None:
        self.calls.append(("assign", (generation, partitions)))


def coordinator(generation: int = 7, member_id: str = "m-1") -> SimpleNamespace:
    """What the listener reads of the consumer's group coordinator."""
    return SimpleNamespace(
        group_id="g", generation=generation, member_id=member_id, _group_instance_id=None
    )


def listener(
    processor: _Processor,
    assignor: StickyAssignor,
    consumer: SimpleNamespace | None = None,
    figures: MemberFigures | None = None,
    **options: Any,
) -> MemberListener:
    return MemberListener(
        processor,
        consumer=cast(AIOKafkaConsumer, consumer or SimpleNamespace(_coordinator=coordinator())),
        topic=TOPIC,
        assignor=assignor,
        figures=figures or MemberFigures(),
        **options,
    )


async def test_the_processor_gets_its_topics_partitions_and_the_generation() -> None:
    processor, assignor = _Processor(), StickyAssignor()
    member = listener(processor, assignor)
    other = TopicPartition("another.topic", 1)
    await member.on_partitions_revoked({TopicPartition(TOPIC, 0), other})
    await member.on_partitions_assigned({TopicPartition(TOPIC, 2), TopicPartition(TOPIC, 5), other})
    assert processor.calls == [
        ("quiesce", frozenset({0})),
        ("assign", (7, frozenset({2, 5}))),
    ]
    assert assignor.generation == 7, "noted for the sticky assignor's next join"


async def test_a_revocation_that_does_not_end_is_cut_short_so_the_member_rejoins(
    caplog: pytest.LogCaptureFixture,
) -> None:
    processor = _Processor(stuck=True)
    member = listener(processor, StickyAssignor(), within=0.05)
    await member.on_partitions_revoked({TopicPartition(TOPIC, 3)})
    assert processor.cancelled
    assert processor.calls == [("quiesce", frozenset({3})), ("cut short", frozenset({3}))]
    assert "not quiesced within" in caplog.text


async def test_a_member_that_joined_again_under_a_new_member_id_is_told_before_its_assignment() -> (
    None
):
    """Its session expired (paused, cut off): the group went on without it, so the processor
    must keep none of its partitions. A member id kept across rebalances tells nothing."""
    processor = _Processor()
    consumer = SimpleNamespace(_coordinator=coordinator())
    member = listener(processor, StickyAssignor(), consumer)
    await member.on_partitions_assigned({TopicPartition(TOPIC, 1)})
    consumer._coordinator = coordinator(generation=8)
    await member.on_partitions_assigned({TopicPartition(TOPIC, 1)})
    consumer._coordinator = coordinator(generation=10, member_id="m-2")
    await member.on_partitions_assigned({TopicPartition(TOPIC, 1)})
    assert processor.calls == [
        ("assign", (7, frozenset({1}))),
        ("assign", (8, frozenset({1}))),
        ("rejoined", "m-2"),
        ("assign", (10, frozenset({1}))),
    ]


async def test_every_assignment_is_counted_as_a_rebalance_of_the_member() -> None:
    """Whatever the processor does with it, and whichever partitions it names (none of the
    member's topic, too): the member took part in a rebalance."""
    figures = MemberFigures()
    member = listener(_Processor(), StickyAssignor(), figures=figures)
    await member.on_partitions_revoked({TopicPartition(TOPIC, 0)})
    assert figures.rebalances == 0, "a revocation is not an assignment"
    await member.on_partitions_assigned({TopicPartition(TOPIC, 0)})
    await member.on_partitions_assigned({TopicPartition("another.topic", 1)})
    assert figures.rebalances == 2
