"""What every member of a partitioned consumer group shares, triggerer or scheduler: the
sticky assignor, the rebalance listener that drives a role's partition processor, a
partition's lifecycle, what an assignment changes, how long a fetch may wait on the broker,
the local database a partition's checkpoint lives in, and the member's one producer."""

from ._assignment import AssignmentDiff, diff_assignment
from ._checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointHeader,
    CheckpointUnusable,
    DiscardedCheckpoints,
    MemberCheckpoint,
)
from ._fetch_wait import LONG_POLL_MS, SHORT_WAIT_MS, answers_fetches_early, choose_fetch_wait
from ._figures import MemberFigures
from ._lifecycle import MOVES, IllegalPartitionMove, PartitionPhase, moved
from ._listener import MemberListener, PartitionProcessor
from ._metrics import MemberCollector, MemberMetricNames
from ._partition_db import (
    ROW_PREFIX,
    MemoryPartitionDatabase,
    PartitionDatabase,
    RocksPartitionDatabase,
)
from ._producer import (
    MemberFenced,
    MemberProducer,
    MemberProducerError,
    Outgoing,
    Placed,
)
from ._sticky_assignor import StickyAssignor

__all__ = [
    "CHECKPOINT_FORMAT",
    "LONG_POLL_MS",
    "MOVES",
    "ROW_PREFIX",
    "SHORT_WAIT_MS",
    "AssignmentDiff",
    "CheckpointHeader",
    "CheckpointUnusable",
    "DiscardedCheckpoints",
    "IllegalPartitionMove",
    "MemberCheckpoint",
    "MemberCollector",
    "MemberFenced",
    "MemberFigures",
    "MemberListener",
    "MemberMetricNames",
    "MemberProducer",
    "MemberProducerError",
    "MemoryPartitionDatabase",
    "Outgoing",
    "PartitionDatabase",
    "PartitionPhase",
    "PartitionProcessor",
    "Placed",
    "RocksPartitionDatabase",
    "StickyAssignor",
    "answers_fetches_early",
    "choose_fetch_wait",
    "diff_assignment",
    "moved",
]
