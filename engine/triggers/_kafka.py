"""Wait for a Kafka message that matches (Airflow's ``AwaitMessageTrigger``, declaratively)."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from .._trigger import BaseTrigger, TriggerEvent
from ._validate import aware_datetime, positive_seconds, text

__all__ = ["KafkaMessageTrigger", "json_contains"]

_TOPIC = re.compile(r"^[A-Za-z0-9._\-]{1,249}$")
_POSITIONS = ("earliest", "latest")


def json_contains(actual: Any, expected: Any) -> bool:
    """True when ``expected`` is a subset of ``actual``: objects match key by key, recursively
    (extra keys in ``actual`` are fine); everything else must be equal."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            key in actual and json_contains(actual[key], value) for key, value in expected.items()
        )
    if isinstance(expected, bool) or isinstance(actual, bool):
        return actual is expected  # JSON true is not 1
    return bool(actual == expected)


class MessageConditions:
    """What a message must be for a Kafka trigger to take it, each condition optional:
    ``match`` (a JSON object its value contains), ``key`` (its key) and ``value_regex``
    (found in its text). Checked when built, so a bad argument fails where the trigger is made.
    """

    __slots__ = ("_regex", "key", "match", "value_regex")

    def __init__(
        self, match: Mapping[str, Any] | None, key: str | None, value_regex: str | None
    ) -> None:
        if match is not None and not isinstance(match, Mapping):
            raise TypeError("match must be a JSON object (a mapping), e.g. {'status': 'done'}")
        self.match = dict(match) if match is not None else None
        self.key = text(key, "key", optional=True)
        self.value_regex = text(value_regex, "value_regex", optional=True)
        try:
            self._regex = re.compile(self.value_regex) if self.value_regex else None
        except re.error as exc:
            raise ValueError(f"value_regex is not a valid regular expression: {exc}") from exc

    def __call__(self, key: bytes | None, value: bytes | None) -> bool:
        """Whether a message with this key and value meets every condition."""
        if self.key is not None and (key is None or key != self.key.encode()):
            return False
        regex = self._regex
        if regex is not None and (
            value is None or not regex.search(value.decode("utf-8", errors="replace"))
        ):
            return False
        if self.match is not None:
            try:
                document = orjson.loads(value) if value is not None else None
            except orjson.JSONDecodeError:
                return False
            if not json_contains(document, self.match):
                return False
        return True


def topic_name(topic: object) -> str:
    """``topic``, checked to be a legal Kafka topic name."""
    name: str = text(topic, "topic")  # type: ignore[assignment]
    if not _TOPIC.match(name):
        raise ValueError(f"topic {topic!r} is not a legal Kafka topic name")
    return name


def consumer_config_of(
    config: Mapping[str, Any] | None, *, forbidden: frozenset[str]
) -> dict[str, Any] | None:
    """Extra ``AIOKafkaConsumer`` arguments, checked: none of ``forbidden`` (the trigger's own)."""
    if config is not None and (
        not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config)
    ):
        raise TypeError("consumer_config must be a mapping of AIOKafkaConsumer arguments")
    clash = forbidden & set(config or ())
    if clash:
        raise ValueError(f"consumer_config must not set {', '.join(sorted(clash))}")
    return dict(config) if config else None


async def topic_partitions(
    consumer: Any, topic: str, poll_timeout: float, log: logging.Logger
) -> list[Any]:
    """Every partition of ``topic``, once it exists (asked every ``poll_timeout`` seconds)."""
    from aiokafka import TopicPartition

    while True:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            # A consumer without subscriptions tracks no topic metadata: ask the cluster.
            cluster = await consumer._client.fetch_all_metadata()
            partitions = cluster.partitions_for_topic(topic)
        if partitions:
            return [TopicPartition(topic, p) for p in sorted(partitions)]
        log.debug("topic %s not found yet; waiting", topic)
        await asyncio.sleep(poll_timeout)


def decode_value(raw: bytes | None) -> Any:
    """A message value as JSON if it parses, else text, else the raw bytes."""
    if raw is None:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


class KafkaMessageTrigger(BaseTrigger):
    """Fire on the first message of ``topic`` that matches every given condition.

    Conditions (all optional; none means the first message fires):

    * ``match``: a JSON object that must be a subset of the message value (decoded as JSON);
    * ``key``: the message key must equal this string;
    * ``value_regex``: this regular expression must be found in the value text.

    Where reading starts: ``since`` (a timezone-aware datetime; default: when the trigger
    was created, which is serialized, so a copy of the trigger started elsewhere after a
    rebalance looks at the same messages and fires the same event), or ``"earliest"`` /
    ``"latest"``. The trigger reads every partition with manual assignment and commits
    nothing. The connection is the triggerer's own cluster (:func:`deferline.topics.home_settings`)
    unless ``bootstrap_servers`` is given; ``consumer_config`` passes extra ``AIOKafkaConsumer``
    arguments (security settings, for example).

    Payload: ``{"topic", "partition", "offset", "timestamp", "key", "value"}`` with the
    value decoded as JSON when it parses, else as text.
    """

    def __init__(
        self,
        topic: str,
        match: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        value_regex: str | None = None,
        since: dt.datetime | str | None = None,
        bootstrap_servers: str | list[str] | None = None,
        consumer_config: Mapping[str, Any] | None = None,
        poll_timeout: float = 1.0,
    ) -> None:
        super().__init__()
        self.topic = topic_name(topic)
        self.conditions = MessageConditions(match, key, value_regex)
        if since is None:
            since = dt.datetime.now(dt.UTC)
        if isinstance(since, str) and since in _POSITIONS:
            self.since: dt.datetime | str = since
        else:
            self.since = aware_datetime(since, "since")
        servers_ok = (isinstance(bootstrap_servers, str) and bool(bootstrap_servers)) or (
            isinstance(bootstrap_servers, list)
            and bool(bootstrap_servers)
            and all(isinstance(s, str) and s for s in bootstrap_servers)
        )
        if bootstrap_servers is not None and not servers_ok:
            raise TypeError("bootstrap_servers must be 'host:port[,host:port]' or a list of them")
        self.bootstrap_servers = bootstrap_servers
        self.consumer_config = consumer_config_of(
            consumer_config, forbidden=frozenset({"group_id", "enable_auto_commit"})
        )
        self.poll_timeout = positive_seconds(poll_timeout, "poll_timeout")

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "deferline.engine.triggers.KafkaMessageTrigger",
            {
                "topic": self.topic,
                "match": self.conditions.match,
                "key": self.conditions.key,
                "value_regex": self.conditions.value_regex,
                "since": self.since,
                "bootstrap_servers": self.bootstrap_servers,
                "consumer_config": self.consumer_config,
                "poll_timeout": self.poll_timeout,
            },
        )

    def matches(self, key: bytes | None, value: bytes | None, timestamp_ms: int) -> bool:
        """Whether one message satisfies every condition."""
        if (
            isinstance(self.since, dt.datetime)
            and timestamp_ms >= 0
            and timestamp_ms < int(self.since.timestamp() * 1000)
        ):
            return False
        return self.conditions(key, value)

    def _make_consumer(self) -> Any:
        """An unstarted aiokafka consumer without a group (overridable in tests)."""
        overrides: dict[str, Any] = {
            "group_id": None,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "fetch_max_wait_ms": 50,
            **(self.consumer_config or {}),
        }
        if self.bootstrap_servers is None:
            from deferline.topics import home_settings, make_consumer

            return make_consumer(home_settings(), **overrides)
        from aiokafka import AIOKafkaConsumer

        return AIOKafkaConsumer(bootstrap_servers=self.bootstrap_servers, **overrides)

    async def _assign(self, consumer: Any) -> None:
        """Assign every partition of the topic and seek to where reading starts."""
        tps = await topic_partitions(consumer, self.topic, self.poll_timeout, self.log)
        consumer.assign(tps)
        if self.since == "earliest":
            await consumer.seek_to_beginning(*tps)
        elif self.since == "latest":
            ends = await consumer.end_offsets(tps)
            for tp in tps:
                consumer.seek(tp, ends[tp])
        else:
            assert isinstance(self.since, dt.datetime)
            # End offsets first: a message that lands after this call is read, not skipped.
            ends = await consumer.end_offsets(tps)
            found = await consumer.offsets_for_times(
                {tp: int(self.since.timestamp() * 1000) for tp in tps}
            )
            for tp in tps:
                hit = found.get(tp)
                consumer.seek(tp, hit.offset if hit is not None else ends[tp])

    async def run(self) -> AsyncIterator[TriggerEvent]:
        consumer = self._make_consumer()
        try:  # stopped even if its start fails or the trigger is cancelled meanwhile
            from deferline.topics import start_client

            await start_client(consumer, grace=5.0, name="message trigger consumer")
            await self._assign(consumer)
            self.log.debug("reading %s from %s", self.topic, self.since)
            timeout_ms = int(self.poll_timeout * 1000)
            while True:
                batches = await consumer.getmany(timeout_ms=timeout_ms, max_records=500)
                for tp in sorted(batches, key=lambda tp: tp.partition):
                    for message in batches[tp]:
                        if self.matches(message.key, message.value, message.timestamp):
                            yield TriggerEvent(self._payload(message))
                            return
        finally:
            from deferline.topics import stop_client

            await stop_client(consumer, grace=5.0, name="KafkaMessageTrigger consumer")

    def _payload(self, message: Any) -> dict[str, Any]:
        key = message.key
        return {
            "topic": message.topic,
            "partition": message.partition,
            "offset": message.offset,
            "timestamp": dt.datetime.fromtimestamp(message.timestamp / 1000, dt.UTC)
            if message.timestamp is not None and message.timestamp >= 0
            else None,
            "key": key.decode("utf-8", errors="replace") if key is not None else None,
            "value": decode_value(message.value),
        }
