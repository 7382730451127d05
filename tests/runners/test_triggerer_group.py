"""A lane in its consumer group: one JoinGroup per join (aiokafka corrected)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from aiokafka import AIOKafkaConsumer
from aiokafka.consumer.group_coordinator import CoordinatorGroupRebalance
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.errors import UnknownMemberIdError
from aiokafka.protocol.group import JoinGroupRequest
from deferline.runners.member import StickyAssignor
from deferline.runners.testing import join_once


class _Subscription:
    topics = frozenset({"deferline.defer"})
    active = True


class _Coordinator:
    """What ``perform_group_join`` uses of aiokafka's coordinator; records what is sent."""

    def __init__(self, assignors: list[Any]) -> None:
        self._assignors = assignors
        self._rebalance_timeout_ms = 30_000
        self._group_instance_id = None
        self.member_id = "m-1"
        self.sent: list[Any] = []

    async def _send_req(self, request: Any) -> Any:
        self.sent.append(request)

        class Answer:  # ends the join at once: the member id is forgotten, no SyncGroup
            error_code = UnknownMemberIdError.errno

        return Answer()

    def reset_generation(self) -> None:
        self.member_id = JoinGroupRequest.UNKNOWN_MEMBER_ID


def _consumer(coordinator: _Coordinator) -> AIOKafkaConsumer:
    """A consumer as far as ``join_once`` looks at one: its coordinator."""
    return cast(AIOKafkaConsumer, SimpleNamespace(_coordinator=coordinator))


async def _join(coordinator: _Coordinator) -> None:
    rebalance = CoordinatorGroupRebalance(
        coordinator,
        "deferline.triggerer",
        1,
        _Subscription(),
        coordinator._assignors,
        10_000,
        100,
    )
    assert await rebalance.perform_group_join() is None


async def test_a_join_sends_one_joingroup_offering_every_assignor() -> None:
    assignors = [StickyAssignor(), RoundRobinPartitionAssignor]
    coordinator = _Coordinator(assignors)
    join_once(_consumer(coordinator))

    await _join(coordinator)

    joins = [r for r in coordinator.sent if isinstance(r, JoinGroupRequest)]
    assert len(joins) == 1
    assert [name for name, _ in joins[0]._group_protocols] == [
        StickyAssignor.name,
        RoundRobinPartitionAssignor.name,
    ]


async def test_without_the_adjustment_aiokafka_sends_one_joingroup_per_assignor() -> None:
    """The behaviour ``join_once`` corrects: if aiokafka fixes it, this test says so."""
    coordinator = _Coordinator([StickyAssignor(), RoundRobinPartitionAssignor])

    await _join(coordinator)

    assert len([r for r in coordinator.sent if isinstance(r, JoinGroupRequest)]) == 2


async def test_other_requests_go_out_unchanged() -> None:
    coordinator = _Coordinator([StickyAssignor(), RoundRobinPartitionAssignor])
    join_once(_consumer(coordinator))
    request = object()

    answer = await coordinator._send_req(request)

    assert coordinator.sent == [request]
    assert answer.error_code == UnknownMemberIdError.errno
