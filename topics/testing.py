"""Internals exposed for deferline's own tests and benchmarks.

Not part of the public API: no compatibility promise; names here move or go without notice.
"""

from ._acls import create_acls
from ._clients import connection_kwargs, is_bootstrap_failure
from ._kafka_runtime import _new_cluster_id
from ._kraft import _scram_arguments, _secured_properties
from ._log_identity import _IdentityRequest, _MetadataRequest_v10
from ._partitioner import _murmur2_python, _unsigned, murmur2_reference
from ._process import _metadata_has_broker, free_port, terminate_all

__all__ = [
    "_IdentityRequest",
    "_MetadataRequest_v10",
    "_metadata_has_broker",
    "_murmur2_python",
    "_new_cluster_id",
    "_scram_arguments",
    "_secured_properties",
    "_unsigned",
    "connection_kwargs",
    "create_acls",
    "free_port",
    "is_bootstrap_failure",
    "murmur2_reference",
    "terminate_all",
]
