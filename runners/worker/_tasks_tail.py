"""The worker's reader of the tasks topic: the dedup fold, kept up to date."""

from __future__ import annotations

import asyncio
import logging

from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord
from deferline.schemas import SchemaError, TaskStateRecord, decode_as
from deferline.topics import (
    Lifecycle,
    Settings,
    TopicNames,
    make_consumer,
    start_client,
    stop_client,
)

from ._errors import WorkerError
from ._state import AttemptProgress

__all__ = ["TasksTail"]

logger = logging.getLogger(__name__)


class TasksTail(Lifecycle):
    """Reads the tasks topic from the start into :class:`AttemptProgress`, and keeps up."""

    def __init__(self, settings: Settings, progress: AttemptProgress) -> None:
        self._topic = TopicNames(settings.topic_prefix).tasks
        self._progress = progress
        self._consumer = make_consumer(settings, self._topic, group_id=None)
        self._advanced = asyncio.Event()
        self.records = 0

    async def start(self) -> None:
        try:
            await start_client(self._consumer, grace=5.0, name="tasks tail consumer")
        except KafkaError as exc:
            raise WorkerError(f"cannot read {self._topic}: {exc}") from exc

    async def stop(self) -> None:
        await stop_client(self._consumer, grace=10.0, name="tasks tail consumer")

    async def run(self) -> None:
        """Fold records until cancelled."""
        consumer = self._consumer
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            except KafkaError as exc:
                raise WorkerError(f"reading {self._topic} failed: {exc}") from exc
            for records in batches.values():
                for record in records:
                    self._fold(record)
            self._advanced.set()

    def _fold(self, record: ConsumerRecord[bytes, bytes]) -> None:
        self.records += 1
        if record.value is None:
            if record.key is not None:
                self._progress.forget(record.key.decode(errors="replace"))
            return
        try:
            state = decode_as(record.value, TaskStateRecord)
        except SchemaError as exc:
            logger.warning(
                "unreadable record on the tasks topic skipped: %s",
                exc,
                extra={"partition": record.partition, "offset": record.offset},
            )
            return
        self._progress.observe(state)

    async def sync(self) -> None:
        """Return once everything on the tasks topic as of now has been folded."""
        consumer = self._consumer
        while not consumer.assignment():
            self._advanced.clear()
            await self._advanced.wait()
        tps = sorted(consumer.assignment())
        try:
            ends = await consumer.end_offsets(tps)
        except KafkaError as exc:
            raise WorkerError(f"cannot read end offsets of {self._topic}: {exc}") from exc
        while True:
            behind = False
            for tp in tps:
                if await consumer.position(tp) < ends[tp]:
                    behind = True
                    break
            if not behind:
                return
            self._advanced.clear()
            await self._advanced.wait()
