"""The sticky assignor: balanced shares, partitions kept where they are, newest claim wins."""

from __future__ import annotations

from typing import Any

from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata
from aiokafka.structs import TopicPartition
from deferline.runners.member import StickyAssignor
from deferline.runners.member.testing import balanced_sticky

TOPIC = "t"


def moved(before: dict[str, list[int]], after: dict[str, list[int]]) -> int:
    owner = {n: m for m, ns in before.items() for n in ns}
    return sum(1 for m, ns in after.items() for n in ns if owner.get(n) not in (None, m))


def test_a_join_moves_only_the_new_members_share() -> None:
    before = balanced_sticky(range(12), ["a", "b"], {})
    claims = {m: (1, ns) for m, ns in before.items()}
    after = balanced_sticky(range(12), ["a", "b", "c"], claims)
    assert sorted(len(ns) for ns in after.values()) == [4, 4, 4]
    assert moved(before, after) == 4
    assert set(after["a"]) <= set(before["a"])
    assert set(after["b"]) <= set(before["b"])


def test_a_leave_moves_only_the_leavers_partitions() -> None:
    before = balanced_sticky(range(12), ["a", "b", "c"], {})
    claims = {m: (1, ns) for m, ns in before.items() if m != "c"}
    after = balanced_sticky(range(12), ["a", "b"], claims)
    assert set(before["a"]) <= set(after["a"])
    assert set(before["b"]) <= set(after["b"])
    assert sorted(after["a"] + after["b"]) == list(range(12))


def test_uneven_shares_go_to_the_members_keeping_most() -> None:
    after = balanced_sticky(range(7), ["a", "b"], {"a": (3, [0, 1, 2, 3]), "b": (3, [4, 5, 6])})
    assert after == {"a": [0, 1, 2, 3], "b": [4, 5, 6]}


def test_a_conflicting_claim_goes_to_the_newer_generation() -> None:
    after = balanced_sticky(range(4), ["a", "b"], {"a": (2, [0, 1, 2]), "b": (5, [2, 3])})
    assert after["b"] == [2, 3]
    assert after["a"] == [0, 1]


def test_unknown_partitions_in_a_claim_are_ignored() -> None:
    after = balanced_sticky(range(2), ["a"], {"a": (1, [0, 7])})
    assert after == {"a": [0, 1]}


class _Cluster:
    def partitions_for_topic(self, topic: str) -> set[int]:
        return set(range(6))


def test_the_assignor_round_trips_its_claims_through_member_metadata() -> None:
    a, b = StickyAssignor(), StickyAssignor()
    first = a.assign(_Cluster(), {"a": a.metadata([TOPIC]), "b": b.metadata([TOPIC])})
    a.on_assignment(first["a"])
    b.on_assignment(first["b"])
    a.note_generation(1)
    b.note_generation(1)
    c = StickyAssignor()
    members: dict[str, Any] = {"a": a.metadata([TOPIC]), "b": b.metadata([TOPIC])}
    members["c"] = c.metadata([TOPIC])
    second = a.assign(_Cluster(), members)
    before = {m: [tp.partition for tp in first[m].partitions()] for m in ("a", "b")}
    after = {m: [tp.partition for tp in second[m].partitions()] for m in ("a", "b", "c")}
    assert moved(before, after) == 2
    assert all(len(ns) == 2 for ns in after.values())
    assert all(isinstance(tp, TopicPartition) for tp in second["c"].partitions())


def test_unreadable_user_data_counts_as_no_claim() -> None:
    assignor = StickyAssignor()
    junk = ConsumerProtocolMemberMetadata(0, [TOPIC], b"not json")
    result = assignor.assign(_Cluster(), {"a": junk})
    assert sorted(tp.partition for tp in result["a"].partitions()) == list(range(6))
