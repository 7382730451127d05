"""Internals of deferline.runners for deferline's tests and benchmarks only."""

from ._aiokafka import (
    AiokafkaInternalsError,
    FencedByGroup,
    GroupMetadata,
    UnstableOffsets,
    abort_reaches_the_broker,
    admin_client,
    client_of,
    commit_offsets_with_generation,
    fetch_stable_offsets,
    group_generation,
    group_metadata,
    join_once,
    leave_from_generation_zero,
    offsets_of_several_groups,
    set_fetch_wait,
)
from ._aiokafka import _GenerationTxnOffsetCommit as GenerationTxnOffsetCommit
from ._aiokafka import _StableOffsetFetch as StableOffsetFetch
from ._broker_cmd import broker
from ._gc import collect_less_often
from ._local_state import CheckpointError, CheckpointInUse
from ._logging import JsonFormatter, TextFormatter
from ._metrics import MetricsServer
from ._options import connection_options, layout_options
from ._outage import ClusterOutageTooLong, ClusterWatch, is_cluster_loss, ride_out
from ._signals import run_until_signal
from ._task_cmds import _as_json as as_json

__all__ = [
    "AiokafkaInternalsError",
    "CheckpointError",
    "CheckpointInUse",
    "ClusterOutageTooLong",
    "ClusterWatch",
    "FencedByGroup",
    "GenerationTxnOffsetCommit",
    "GroupMetadata",
    "JsonFormatter",
    "MetricsServer",
    "StableOffsetFetch",
    "TextFormatter",
    "UnstableOffsets",
    "abort_reaches_the_broker",
    "admin_client",
    "as_json",
    "broker",
    "client_of",
    "collect_less_often",
    "commit_offsets_with_generation",
    "connection_options",
    "fetch_stable_offsets",
    "group_generation",
    "group_metadata",
    "is_cluster_loss",
    "join_once",
    "layout_options",
    "leave_from_generation_zero",
    "offsets_of_several_groups",
    "ride_out",
    "run_until_signal",
    "set_fetch_wait",
]
