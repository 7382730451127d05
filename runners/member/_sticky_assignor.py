"""A sticky partition assignor for the eager group protocol: partitions stay where they are.

Each member sends, with its subscription, the partitions it owns and the generation it got
them in. The leader lets every member keep what it owns, up to a balanced share (the
members keeping most get the larger shares), and hands out only what is left over: a join
moves about 1/N of the partitions, a leave moves only the leaver's. When two members claim
the same partition (one was dropped from the group and came back), the newer generation
wins.

aiokafka ships ``StickyPartitionAssignor``, but it keeps its memory on the class (every
consumer of a process would share one "previous assignment", and a triggerer runs one
consumer per trigger queue) and aiokafka never feeds it the generation. This one keeps its
state on the instance: one instance per consumer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)
from aiokafka.structs import TopicPartition

__all__ = ["StickyAssignor", "balanced_sticky"]

logger = logging.getLogger(__name__)

NAME = "deferline-sticky"
_VERSION = 0


def balanced_sticky(
    partitions: Iterable[int],
    members: Iterable[str],
    claims: Mapping[str, tuple[int, Iterable[int]]],
) -> dict[str, list[int]]:
    """Assign ``partitions`` to ``members``, keeping claimed ones where balance allows.

    ``claims`` maps a member to ``(generation, partitions it owned)``. Every member gets
    ``len(partitions) // len(members)`` partitions or one more; a member keeps as many of
    its claimed partitions as its share allows.
    """
    pool = sorted(set(partitions))
    names = sorted(set(members))
    if not names:
        return {}
    owner: dict[int, tuple[int, str]] = {}
    valid = set(pool)
    for member in names:
        generation, owned = claims.get(member, (-1, ()))
        for number in owned:
            if number not in valid:
                continue
            held = owner.get(number)
            # Newer generation wins; on a tie the first member name (deterministic).
            if held is None or generation > held[0]:
                owner[number] = (generation, member)
    kept: dict[str, list[int]] = {m: [] for m in names}
    for number, (_, member) in sorted(owner.items()):
        kept[member].append(number)
    base, extra = divmod(len(pool), len(names))
    order = sorted(names, key=lambda m: (-len(kept[m]), m))
    quota = {member: base + (1 if index < extra else 0) for index, member in enumerate(order)}
    free = [number for number in pool if number not in owner]
    for member in names:
        if len(kept[member]) > quota[member]:
            free.extend(kept[member][quota[member] :])
            del kept[member][quota[member] :]
    free.sort(reverse=True)
    for member in order:
        while len(kept[member]) < quota[member]:
            kept[member].append(free.pop())
        kept[member].sort()
    return kept


class StickyAssignor:
    """aiokafka's assignor interface (``name``, ``metadata``, ``assign``, ``on_assignment``).

    Lanes list ``[StickyAssignor(), RoundRobinPartitionAssignor]``: a group that still has
    older members (round robin only) forms during a rolling upgrade, since the broker picks
    a protocol every member supports.
    """

    name = NAME
    version = _VERSION

    def __init__(self) -> None:
        self.owned: list[TopicPartition] = []
        self.generation = -1

    def note_generation(self, generation: int) -> None:
        """The generation of the assignment last received (sent with the next join)."""
        self.generation = generation

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        by_topic: dict[str, list[int]] = {}
        for tp in self.owned:
            by_topic.setdefault(tp.topic, []).append(tp.partition)
        user_data = json.dumps({"generation": self.generation, "owned": by_topic}).encode()
        return ConsumerProtocolMemberMetadata(self.version, sorted(topics), user_data)

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:
        self.owned = list(assignment.partitions())

    def assign(
        self, cluster: Any, members: Mapping[str, ConsumerProtocolMemberMetadata]
    ) -> dict[str, ConsumerProtocolMemberAssignment]:
        claims: dict[str, tuple[int, dict[str, list[int]]]] = {
            member: _claims(metadata) for member, metadata in members.items()
        }
        topics = sorted({t for metadata in members.values() for t in metadata.subscription})
        result: dict[str, dict[str, list[int]]] = {member: {} for member in members}
        for topic in topics:
            partitions = cluster.partitions_for_topic(topic) or set()
            subscribers = [m for m, meta in members.items() if topic in meta.subscription]
            share = balanced_sticky(
                partitions,
                subscribers,
                {m: (claims[m][0], claims[m][1].get(topic, [])) for m in subscribers},
            )
            for member, numbers in share.items():
                if numbers:
                    result[member][topic] = numbers
        return {
            member: ConsumerProtocolMemberAssignment(self.version, sorted(topics.items()), b"")
            for member, topics in result.items()
        }


def _claims(metadata: ConsumerProtocolMemberMetadata) -> tuple[int, dict[str, list[int]]]:
    """What a member says it owned; nothing when its user data is absent or unreadable."""
    raw = metadata.user_data
    if not raw:
        return -1, {}
    try:
        data = json.loads(raw)
        owned = {str(t): [int(n) for n in ns] for t, ns in dict(data["owned"]).items()}
        return int(data["generation"]), owned
    except (ValueError, KeyError, TypeError) as exc:
        logger.warning("unreadable sticky-assignor user data ignored", extra={"error": repr(exc)})
        return -1, {}
