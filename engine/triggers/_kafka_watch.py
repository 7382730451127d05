"""Watch a Kafka topic: one event per matching message, read exactly once through restarts."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Mapping
from typing import Any

from .._trigger import BaseTrigger, SourcedEvent, SourcePosition, TriggerEvent
from ._kafka import (
    MessageConditions,
    consumer_config_of,
    decode_value,
    topic_name,
    topic_partitions,
)
from ._validate import positive_seconds, text

__all__ = ["KafkaWatchTrigger"]

_STARTS = ("earliest", "latest")


class KafkaWatchTrigger(BaseTrigger):
    """A standing watch on ``topic``: an event for every message that matches, forever.

    Made for Airflow's asset watchers (``deferline.engine.triggers.airflow`` has the class an
    ``AssetWatcher`` takes) and for any :class:`~deferline.schemas.WatchRequest`. It reads
    every partition of ``topic`` on the triggerer's own cluster from the committed offsets
    of the consumer group ``group`` (from ``start``, ``"earliest"`` or ``"latest"``, where
    the group has none), and yields a :class:`~deferline.engine.SourcedEvent` per message
    that matches: whoever publishes the event commits the message's offset for ``group``,
    in the event's transaction where the triggerer writes in transactions. So a message
    whose event was published is not read again after a restart or a rebalance, and one
    whose event was lost is; a message read again (no transactions: the commit follows the
    ack) is the same event, named after its partition and offset, which the consumer of
    the watch's events drops by id. The trigger itself commits nothing (unless
    ``commits_offsets`` is set: Airflow's own triggerer, which commits nothing for it).

    Conditions, all optional: ``match`` (a JSON object the value must contain), ``key``
    (the message key), ``value_regex``. A message that matches none is skipped; its offset
    is committed with the partition's next event. ``consumer_config`` passes extra
    ``AIOKafkaConsumer`` arguments.

    Payload: ``{"topic", "partition", "offset", "timestamp", "key", "value"}``, the
    timestamp as ISO-8601 text, the value decoded as JSON when it parses, else as text.
    """

    def __init__(
        self,
        topic: str,
        group: str,
        match: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        value_regex: str | None = None,
        start: str = "earliest",
        consumer_config: Mapping[str, Any] | None = None,
        poll_timeout: float = 1.0,
    ) -> None:
        super().__init__()
        self.topic = topic_name(topic)
        self.group: str = text(group, "group")  # type: ignore[assignment]
        self.conditions = MessageConditions(match, key, value_regex)
        if start not in _STARTS:
            raise ValueError(f"start must be 'earliest' or 'latest', not {start!r}")
        self.start = start
        self.consumer_config = consumer_config_of(
            consumer_config,
            forbidden=frozenset({"group_id", "enable_auto_commit", "auto_offset_reset"}),
        )
        self.poll_timeout = positive_seconds(poll_timeout, "poll_timeout")
        self.commits_offsets = False
        """Commit each message's offset once its event is handed over (not serialized: set
        where no publisher commits them)."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "deferline.engine.triggers.KafkaWatchTrigger",
            {
                "topic": self.topic,
                "group": self.group,
                "match": self.conditions.match,
                "key": self.conditions.key,
                "value_regex": self.conditions.value_regex,
                "start": self.start,
                "consumer_config": self.consumer_config,
                "poll_timeout": self.poll_timeout,
            },
        )

    def _make_consumer(self) -> Any:
        """An unstarted aiokafka consumer of ``group`` (overridable in tests)."""
        from deferline.topics import home_settings, make_consumer

        return make_consumer(
            home_settings(),
            group_id=self.group,
            enable_auto_commit=False,
            auto_offset_reset=self.start,
            fetch_max_wait_ms=50,
            **(self.consumer_config or {}),
        )

    async def _assign(self, consumer: Any) -> list[Any]:
        """Assign every partition of the topic (waiting for the topic to exist): reading
        starts at the group's committed offsets."""
        tps = await topic_partitions(consumer, self.topic, self.poll_timeout, self.log)
        consumer.assign(tps)
        return tps

    async def run(self) -> AsyncIterator[TriggerEvent]:
        consumer = self._make_consumer()
        try:  # stopped even if its start fails or the trigger is cancelled meanwhile
            from deferline.topics import start_client

            await start_client(consumer, grace=5.0, name="watch consumer")
            tps = await self._assign(consumer)
            self.log.info(
                "watching %s (%d partitions) as group %s", self.topic, len(tps), self.group
            )
            timeout_ms = int(self.poll_timeout * 1000)
            while True:
                batches = await consumer.getmany(timeout_ms=timeout_ms, max_records=500)
                for tp in sorted(batches, key=lambda tp: tp.partition):
                    for message in batches[tp]:
                        if not self.conditions(message.key, message.value):
                            continue
                        at = SourcePosition(self.group, tp.topic, tp.partition, message.offset)
                        yield SourcedEvent(self._payload(message), source=at)
                        if self.commits_offsets:
                            await consumer.commit({tp: message.offset + 1})
        finally:
            from deferline.topics import stop_client

            await stop_client(consumer, grace=5.0, name="KafkaWatchTrigger consumer")

    @staticmethod
    def _payload(message: Any) -> dict[str, Any]:
        key = message.key
        stamp = message.timestamp
        return {
            "topic": message.topic,
            "partition": message.partition,
            "offset": message.offset,
            "timestamp": dt.datetime.fromtimestamp(stamp / 1000, dt.UTC).isoformat()
            if stamp is not None and stamp >= 0
            else None,
            "key": key.decode("utf-8", errors="replace") if key is not None else None,
            "value": decode_value(message.value),
        }
