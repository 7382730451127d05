"""Errors raised by the Kafka-facing layer: admin, clients and broker launchers."""

from __future__ import annotations

from deferline.schemas import DeferlineError


class BrokerError(DeferlineError):
    """Talking to, or starting, a Kafka-protocol broker failed."""


class TopicLayoutError(BrokerError):
    """Existing topics break deferline's layout (a defer/resume pair is not co-partitioned)."""


class BrokerStartError(BrokerError):
    """A broker process could not be assembled, started or reached."""


class InvalidQueueName(DeferlineError, ValueError):
    """A trigger or worker queue name is not usable in a topic name."""
