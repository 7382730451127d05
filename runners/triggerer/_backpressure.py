"""A lane's fetch gate: fetching pauses while too much waits, and resumes at half of it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from ._metrics import TriggererMetrics

logger = logging.getLogger(__name__)


class FetchGate:
    """Pauses a lane's live partitions while pending triggers plus unsent events exceed a
    bound, and resumes them once the load is at half of it (a memory guard against floods:
    while paused, cancels and new deferrals wait in Kafka)."""

    def __init__(
        self, *, label: str, metrics: TriggererMetrics, log: Callable[..., dict[str, Any]]
    ) -> None:
        self._gauge = metrics.fetch_paused.labels(queue=label)
        self._log = log
        self.bound = 10_000
        self.paused = False

    def set_bound(self, bound: int) -> None:
        """Pause fetching while the load exceeds ``bound``."""
        self.bound = max(1, bound)

    def check(self, consumer: AIOKafkaConsumer, load: int, live: list[TopicPartition]) -> None:
        """Pause or resume ``live`` partitions for the ``load`` now."""
        if not self.paused and load > self.bound:
            self.paused = True
            if live:
                consumer.pause(*live)
            self._gauge.set(1)
            logger.info(
                "fetch paused: backlog above bound", extra=self._log(load=load, bound=self.bound)
            )
        elif self.paused and load <= self.bound // 2:
            self.paused = False
            if live:
                consumer.resume(*live)
            self._gauge.set(0)
            logger.info("fetch resumed", extra=self._log(load=load))
