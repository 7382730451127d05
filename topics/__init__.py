"""Kafka-facing foundation: settings, topic layout, partitioner, clients and local brokers."""

from ._acls import ROLES, AclBinding, Role, SchedulerResources, acl_bindings, parse_role_principals
from ._admin import TopicDescription, describe_topics, ensure_acls, ensure_topics
from ._clients import (
    close_client,
    known_position,
    make_admin,
    make_consumer,
    make_producer,
    principal_of,
    start_client,
    stop_client,
    supports_idempotence,
)
from ._errors import (
    AccessError,
    AuthenticationError,
    AuthorizationError,
    BrokerError,
    BrokerStartError,
    InvalidQueueName,
    TopicLayoutError,
    access_error,
)
from ._identity import IdentityMismatch, LogIdentity, TopicIdentity, compare_identity
from ._kafka_runtime import KAFKA_VERSION, fetch_kafka_jars
from ._kraft import BrokerSecurity, KRaftBroker
from ._kraft_cluster import KRaftCluster
from ._lifecycle import Lifecycle, run_closing
from ._log_identity import read_log_identity
from ._names import TopicNames, validate_queue_name
from ._partitioner import Murmur2Partitioner, murmur2, partition_for
from ._process import free_port
from ._settings import Settings, home_settings, use_home_settings
from ._specs import TopicSpec, topic_specs, trigger_logs_spec
from ._tansu import TansuBroker
from ._tls import ThrowawayTLS
from ._tracing import disable_tracing, enable_tracing, trace_receive, trace_send, tracing_on

__all__ = [
    "KAFKA_VERSION",
    "ROLES",
    # Errors
    "AccessError",
    # Access control
    "AclBinding",
    "AuthenticationError",
    "AuthorizationError",
    "BrokerError",
    "BrokerSecurity",
    "BrokerStartError",
    "IdentityMismatch",
    "InvalidQueueName",
    # Local brokers
    "KRaftBroker",
    "KRaftCluster",
    # Lifecycle of long-lived components
    "Lifecycle",
    # What a local checkpoint was read from (with TopicIdentity, compare_identity...)
    "LogIdentity",
    # Partitioning
    "Murmur2Partitioner",
    "Role",
    "SchedulerResources",
    # Configuration
    "Settings",
    "TansuBroker",
    "ThrowawayTLS",
    # Layout
    "TopicDescription",
    "TopicIdentity",
    "TopicLayoutError",
    "TopicNames",
    "TopicSpec",
    "access_error",
    "acl_bindings",
    "close_client",
    "compare_identity",
    "describe_topics",
    "disable_tracing",
    "enable_tracing",
    "ensure_acls",
    "ensure_topics",
    "fetch_kafka_jars",
    "free_port",
    "home_settings",
    "known_position",
    # Clients
    "make_admin",
    "make_consumer",
    "make_producer",
    "murmur2",
    "parse_role_principals",
    "partition_for",
    "principal_of",
    "read_log_identity",
    "run_closing",
    "start_client",
    "stop_client",
    "supports_idempotence",
    "topic_specs",
    "trace_receive",
    "trace_send",
    "tracing_on",
    "trigger_logs_spec",
    "use_home_settings",
    "validate_queue_name",
]
