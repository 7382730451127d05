"""The state a lane's parts share: what :class:`TriggerLane` sets, and the calls between parts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.engine import BaseTrigger, TriggerOutcome, TriggerSupervisor
from deferline.schemas import KwargsCipher
from deferline.topics import Settings, TopicNames

from ._checkpoint import CheckpointStore
from ._emitter import Emitter
from ._events import EventEncoder
from ._lane_types import LaneOptions, OwnedPartition, RebalanceSummary, StopTrigger, TriggerRef
from ._metrics import TriggererMetrics
from ._sticky_assignor import StickyAssignor


class _LaneCore:
    """The state the lane's parts share, and the calls they make into one another.

    :class:`TriggerLane` is built from parts, one module each: rebalance handling, the
    partition rebuild, the live tail, outcomes, and checkpoints and commits. This base only
    declares what they share; the lane's ``__init__`` sets it.
    """

    settings: Settings
    queue: str | None
    label: str
    options: LaneOptions
    member: str
    names: TopicNames
    defer_topic: str
    resume_topic: str
    group_id: str
    rebalance_log: list[RebalanceSummary]
    bootstrapped: asyncio.Event
    _supervisor: TriggerSupervisor
    _emitter: Emitter
    _store: CheckpointStore
    _metrics: TriggererMetrics
    _cipher: KwargsCipher | None
    _cancel: StopTrigger
    _on_fatal: Callable[[BaseException], None]
    _allowed: tuple[str, ...]
    _classes: dict[str, type[BaseTrigger]]
    _deferrals: Any
    _parts: dict[int, OwnedPartition]
    _topic_deleted: bool
    _committed: dict[TopicPartition, int]
    _encoder: EventEncoder
    _consumer: AIOKafkaConsumer | None
    _reader: AIOKafkaConsumer | None
    _bootstrap: asyncio.Task[None] | None
    _closing: bool
    _paused: bool
    _event_counters: dict[str, Any]
    _assignor: StickyAssignor
    _revoked_at: float | None
    _dropping: asyncio.Task[None] | None
    _summary: RebalanceSummary | None
    _rebalance_started: float = 0.0
    _revoked_wall: float = 0.0
    _max_pending: int = 10_000

    def _log(self, part: int | None = None, **fields: Any) -> dict[str, Any]:
        return {"member": self.member, "queue": self.label, "partition": part, **fields}

    def handle_outcome(self, ref: TriggerRef, outcome: TriggerOutcome) -> None:
        raise NotImplementedError

    def _dispatch(self, part: OwnedPartition, key: bytes | None, value: bytes, offset: int) -> bool:
        raise NotImplementedError

    def _tombstone_only(self, part: OwnedPartition, key: bytes, event_offset: int) -> None:
        raise NotImplementedError

    async def _checkpoint(self, part: OwnedPartition) -> None:
        raise NotImplementedError

    async def _commit(self, parts: Sequence[OwnedPartition]) -> None:
        raise NotImplementedError

    async def _bootstrap_guarded(self, parts: list[OwnedPartition]) -> None:
        raise NotImplementedError

    async def _await_dropping(self) -> None:
        raise NotImplementedError

    def _finish_rebalance(self) -> None:
        raise NotImplementedError
