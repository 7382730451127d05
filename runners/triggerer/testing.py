"""Internals of deferline.runners.triggerer for deferline's tests and benchmarks only."""

from ._checkpoint import (
    CheckpointError,
    CheckpointStore,
    MemoryCheckpointStore,
    RocksCheckpointStore,
)
from ._checkpointer import Checkpointer
from ._emitter import Emission, Emitter, Send, source_offsets
from ._events import EventEncoder, encode_event, request_fields
from ._input import BadRecord, CancelTrigger, StartTrigger, interpret
from ._lane import RebalanceSummary, TriggerLane, TriggerRef
from ._lane_types import LaneOptions, OwnedPartition
from ._metrics import TriggererMetrics
from ._partition_book import PartitionBook, Verdict
from ._partition_table import ActiveTriggerTable, TableChanges
from ._rebuild import RebuildReader, start_folded
from ._rebuild_plan import RebuildPlan, Span
from ._source_offsets import SourceOffsets
from ._trigger_logs import TriggerLogCapture
from ._trigger_logs import batches as trigger_log_batches
from ._triggerer import _normalise_queues as normalise_queues
from ._watches import restart_delay

__all__ = [
    "ActiveTriggerTable",
    "BadRecord",
    "CancelTrigger",
    "CheckpointError",
    "CheckpointStore",
    "Checkpointer",
    "Emission",
    "Emitter",
    "EventEncoder",
    "LaneOptions",
    "MemoryCheckpointStore",
    "OwnedPartition",
    "PartitionBook",
    "RebalanceSummary",
    "RebuildPlan",
    "RebuildReader",
    "RocksCheckpointStore",
    "Send",
    "SourceOffsets",
    "Span",
    "StartTrigger",
    "TableChanges",
    "TriggerLane",
    "TriggerLogCapture",
    "TriggerRef",
    "TriggererMetrics",
    "Verdict",
    "encode_event",
    "interpret",
    "normalise_queues",
    "request_fields",
    "restart_delay",
    "source_offsets",
    "start_folded",
    "trigger_log_batches",
]
