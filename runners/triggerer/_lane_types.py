"""The lane's data: options, errors, owned partitions, trigger refs, rebalance summaries."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from aiokafka import TopicPartition
from deferline.engine import TriggerOutcome
from deferline.schemas import DeferlineError

from ._input import peek_identity
from ._partition_book import PartitionBook
from ._partition_table import ActiveTriggerTable


class StopTrigger(Protocol):
    """Stop a trigger this member runs (in the background); ``kill`` when a user cancelled
    it, so the trigger's ``on_kill()`` runs before its ``cleanup()``."""

    def __call__(self, trigger_id: str, *, kill: bool = False) -> None: ...


class TriggererError(DeferlineError):
    """The triggerer cannot go on (it stops, and its partitions move to other members)."""


class BootstrapError(TriggererError):
    """Rebuilding the active set of assigned partitions failed."""


class TopicDeletedError(TriggererError):
    """A topic the triggerer serves was deleted while it ran (its table is gone with it)."""


@dataclass(frozen=True, kw_only=True)
class LaneOptions:
    """How a lane talks to the broker; see :class:`deferline.runners.triggerer.TriggererOptions`."""

    member: str
    direct_resume: bool = False
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 250
    fetch_max_wait_ms: int = 20
    max_poll_records: int = 2_000
    checkpoint_interval: float = 5.0
    checkpoint_max_age: float = 12 * 3600.0
    resume_skew_margin: float = 600.0
    flush_timeout: float = 10.0
    bootstrap_stall_timeout: float = 60.0
    group_instance_id: str | None = None
    """Static membership (KIP-345): rejoining under this id within the session timeout
    gets the same partitions back without a rebalance."""


@dataclass(frozen=True, slots=True, eq=False)
class OutcomeRoute:
    """Where the outcomes of a lane's triggers go: one per lane, shared by its refs."""

    member: str
    """The member running them (read by the supervisor's log lines)."""
    deliver: Callable[[TriggerRef, TriggerOutcome], None]
    """The lane's handling of an outcome (emit, hold or drop, by its partition's phase)."""


@dataclass(slots=True, eq=False)
class TriggerRef:
    """What the supervisor carries for each trigger: where it came from (no decoded copy)
    and where its outcome goes."""

    route: OutcomeRoute
    part: OwnedPartition
    key: bytes
    value: bytes

    @property
    def partition(self) -> int:
        """The defer partition (read by the supervisor's log lines)."""
        return self.part.number

    @property
    def member(self) -> str:
        """The member running it (read by the supervisor's log lines)."""
        return self.route.member

    @property
    def task(self) -> str | None:
        """The task key, decoded on demand (only log lines need it)."""
        _, task, _ = peek_identity(self.value)
        return str(task) if task is not None else None


@dataclass(slots=True, eq=False)
class WatchRef(TriggerRef):
    """A :class:`TriggerRef` for one run of a standing watch: its run id and how many events
    the run has numbered so far."""

    run: str = ""
    seq: int = 0
    once: bool = False
    """The watch ends with this run (its last event is tombstoned with it)."""


Held = tuple[TriggerRef, TriggerOutcome]
"""An outcome held while its partition is quiesced."""


@dataclass(slots=True, eq=False)
class SavePoint:
    """Where a partition's checkpoint stands (written by the lane's checkpointer only)."""

    enabled: bool = True
    """False once the store failed to load it: the partition is not checkpointed again."""
    positions: tuple[int, int] | None = None
    """The (defer, resume) offsets last written or restored."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(slots=True, eq=False)
class OwnedPartition:
    """One assigned defer partition and its co-partitioned resume partition.

    Its lifecycle is ``book`` (one phase); its triggers are ``table`` (set by the rebuild,
    then changed through its own methods); its checkpoint state is ``saved``.
    """

    number: int
    defer_tp: TopicPartition
    resume_tp: TopicPartition
    table: ActiveTriggerTable = field(default_factory=ActiveTriggerTable)
    book: PartitionBook[Held] = field(default_factory=PartitionBook)
    saved: SavePoint = field(default_factory=SavePoint)
    owner: str | None = None
    """The transactional id of the member producer its records are written under (None: no
    transactions): set once no previous owner's round holds its offsets."""

    @property
    def live(self) -> bool:
        """Records from the group consumer are applied and outcomes emitted."""
        return self.book.emitting

    @property
    def ready(self) -> bool:
        """The rebuild finished: the table reflects the log up to ``table.defer_offset``."""
        return self.book.ready


@dataclass(slots=True, kw_only=True)
class RebalanceSummary:
    """What one rebalance did to one lane (logged once, and kept in ``lane.rebalance_log``)."""

    generation: int
    kept: list[int]
    acquired: list[int]
    lost: list[int]
    triggers_kept: int = 0
    triggers_cancelled: int = 0
    triggers_rebuilt: int = 0
    paused_seconds: dict[int, float] = field(default_factory=dict)
    """Per partition: from revocation (or assignment, for a member that had nothing) until
    it emitted again (kept) or followed its tail again (acquired: after the fold of the
    topics, while the folded triggers are still being started; see ``bootstrap_seconds``)."""
    revoked_at: float | None = None
    """Wall-clock time the lane quiesced (None: it owned nothing before)."""
    assigned_at: float = 0.0
    """Wall-clock time the assignment arrived (kept partitions emit again from here)."""
    rebuilt_at: float | None = None
    """Wall-clock time the acquired partitions' triggers were all started (None: none)."""
