"""Kafka-facing foundation: settings, topic layout, partitioner, clients and local brokers."""

from ._admin import TopicDescription, describe_topics, ensure_topics
from ._brokers import KAFKA_VERSION, KRaftBroker, TansuBroker, fetch_kafka_jars
from ._clients import make_admin, make_consumer, make_producer
from ._errors import BrokerError, BrokerStartError, InvalidQueueName, TopicLayoutError
from ._names import TopicNames, validate_queue_name
from ._partitioner import Murmur2Partitioner, murmur2, partition_for
from ._settings import Settings
from ._specs import TopicSpec, topic_specs

__all__ = [
    "KAFKA_VERSION",
    # Errors
    "BrokerError",
    "BrokerStartError",
    "InvalidQueueName",
    # Local brokers
    "KRaftBroker",
    # Partitioning
    "Murmur2Partitioner",
    # Configuration
    "Settings",
    "TansuBroker",
    # Layout
    "TopicDescription",
    "TopicLayoutError",
    "TopicNames",
    "TopicSpec",
    "describe_topics",
    "ensure_topics",
    "fetch_kafka_jars",
    # Clients
    "make_admin",
    "make_consumer",
    "make_producer",
    "murmur2",
    "partition_for",
    "topic_specs",
    "validate_queue_name",
]
