"""How a member hears of the group's moves: one rebalance listener for every role.

aiokafka calls a listener's two callbacks around each rebalance. What is the same for a
triggerer lane and a scheduler lives here: which of the revoked or assigned partitions are of
the member's topic, the generation the member joined (noted for the sticky assignor's next
join), whether it joined again under a new member id, a bound on the revocation, and the
count of rebalances (the member's :class:`~._figures.MemberFigures`). What each role does
with its partitions is its :class:`PartitionProcessor`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from .._aiokafka import group_metadata
from ._figures import MemberFigures
from ._sticky_assignor import StickyAssignor

__all__ = ["MemberListener", "PartitionProcessor"]

logger = logging.getLogger(__name__)


class PartitionProcessor(Protocol):
    """What a member does with the partitions of its topic as the group moves them."""

    async def quiesce(self, partitions: frozenset[int]) -> None:
        """The group is rebalancing and these partitions were this member's: stop writing for
        them and settle what is in flight (the next assignment says which stay)."""

    def quiesce_cut_short(self, partitions: frozenset[int]) -> None:
        """:meth:`quiesce` did not end in time and was cancelled (the member rejoins now)."""

    async def rejoined(self, member_id: str) -> None:
        """The member joined again under a new member id: the group went on without it (its
        session expired: paused or cut off), and another member may have written for any
        partition it held. Keep none of them (called before :meth:`assign`)."""

    async def assign(self, generation: int, partitions: frozenset[int]) -> None:
        """The member's partitions in generation ``generation``: keep, release, acquire."""


class MemberListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """The rebalance callbacks of one member's consumer, driving its processor.

    Args:
        processor: what the member does with its partitions.
        consumer: the member's group consumer (its generation is read at each assignment).
        topic: the member's topic (others of the consumer's are not the processor's).
        assignor: told each generation the member joins (the sticky assignor's user data).
        figures: the member's figures; each assignment is counted there (a rebalance).
        within: seconds a revocation may take; past it the quiesce is cancelled and the
            member rejoins (aiokafka rejoins only once the callback returns, and the whole
            group waits for that rejoin). None: no bound.
        log: the fields of the member's log lines.
    """

    def __init__(
        self,
        processor: PartitionProcessor,
        *,
        consumer: AIOKafkaConsumer,
        topic: str,
        assignor: StickyAssignor,
        figures: MemberFigures,
        within: float | None = None,
        log: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self._processor = processor
        self._consumer = consumer
        self._topic = topic
        self._assignor = assignor
        self._figures = figures
        self._within = within
        self._log = log
        self._member_id: str | None = None  # the group's name for the member, last assigned

    def _mine(self, partitions: Iterable[TopicPartition]) -> frozenset[int]:
        return frozenset(tp.partition for tp in partitions if tp.topic == self._topic)

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        mine = self._mine(revoked)
        if self._within is None:
            await self._processor.quiesce(mine)
            return
        try:
            await asyncio.wait_for(self._processor.quiesce(mine), self._within)
        except TimeoutError:
            logger.error(
                "revocation not quiesced within %.0f s; rejoining the group anyway",
                self._within,
                extra=self._log(),
            )
            self._processor.quiesce_cut_short(mine)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self._figures.assigned()
        member = group_metadata(self._consumer)
        self._assignor.note_generation(member.generation)
        previous, self._member_id = self._member_id, member.member_id
        if previous is not None and previous != member.member_id:
            await self._processor.rejoined(member.member_id)
        await self._processor.assign(member.generation, self._mine(assigned))
