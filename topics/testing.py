"""Internals of deferline.topics for deferline's tests and benchmarks only."""

from ._acls import create_acls
from ._clients import connection_kwargs, is_bootstrap_failure
from ._kafka_runtime import _jvm as jvm_command
from ._kafka_runtime import _new_cluster_id as new_cluster_id
from ._kraft import _scram_arguments as scram_arguments
from ._kraft import _secured_properties as secured_properties
from ._log_identity import _IdentityRequest as IdentityRequest
from ._log_identity import _MetadataRequest_v10 as MetadataRequest_v10
from ._partitioner import _murmur2_python as murmur2_python
from ._partitioner import _unsigned as unsigned
from ._partitioner import murmur2_reference
from ._process import _metadata_has_broker as metadata_has_broker
from ._process import free_port, terminate_all

__all__ = [
    "IdentityRequest",
    "MetadataRequest_v10",
    "connection_kwargs",
    "create_acls",
    "free_port",
    "is_bootstrap_failure",
    "jvm_command",
    "metadata_has_broker",
    "murmur2_python",
    "murmur2_reference",
    "new_cluster_id",
    "scram_arguments",
    "secured_properties",
    "terminate_all",
    "unsigned",
]
