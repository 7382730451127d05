"""A lane's offset commits, and the deleted-topic check before each one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError, UnknownTopicOrPartitionError
from aiokafka.protocol.metadata import MetadataRequest

from .._aiokafka import client_of
from ._lane_types import TopicDeletedError

logger = logging.getLogger(__name__)


class CommitTracker:
    """Commits read positions (informational: lag, and where keyless records were seen).

    It owns what was committed last (an idle member commits nothing) and whether the defer
    topic was found deleted (fatal, reported once).
    """

    def __init__(
        self,
        *,
        topic: str,
        group_id: str,
        within: float,
        on_fatal: Callable[[BaseException], None],
        log: Callable[..., dict[str, Any]],
    ) -> None:
        self._topic = topic
        self._group_id = group_id
        self._within = within
        self._on_fatal = on_fatal
        self._log = log
        self._committed: dict[TopicPartition, int] = {}
        self._topic_deleted = False

    def committed(self, tp: TopicPartition) -> int | None:
        """The offset this lane last committed for ``tp`` (None: none since acquired)."""
        return self._committed.get(tp)

    def forget(self, tp: TopicPartition) -> None:
        """A partition acquired anew: its next commit is not skipped as a repeat."""
        self._committed.pop(tp, None)

    async def commit(
        self,
        consumer: AIOKafkaConsumer | None,
        reader: AIOKafkaConsumer | None,
        offsets: dict[TopicPartition, int],
    ) -> None:
        """Commit ``offsets`` unless nothing changed or the topic is gone."""
        if consumer is None or not offsets or await self.topic_deleted(consumer, reader):
            return  # (aiokafka would retry a commit to a deleted topic every 100 ms)
        if all(self._committed.get(tp) == offset for tp, offset in offsets.items()):
            return
        try:
            # aiokafka waits for a coordinator indefinitely; a commit is only informational.
            await asyncio.wait_for(consumer.commit(offsets), self._within)
        except (KafkaError, AssertionError, TimeoutError) as exc:
            logger.warning("offset commit failed", extra=self._log(error=repr(exc)))
        else:
            self._committed.update(offsets)

    async def topic_deleted(
        self, consumer: AIOKafkaConsumer | None, reader: AIOKafkaConsumer | None
    ) -> bool:
        """True once the defer topic is gone (deleted under the running member).

        Asked by name before each commit, without auto-creation: aiokafka would otherwise
        retry a commit to a deleted topic every 100 ms, and a broker may keep serving empty
        fetches for it. Reported once, at ERROR, as fatal: the member stops (exit 1) rather
        than serve a table that no longer exists; started again, it creates the topic anew
        (unless ``--no-create-topics``) and rebuilds from it.
        """
        if self._topic_deleted:
            return True
        if consumer is None:
            return False
        # Asked over the rebuild reader's connections when it runs: the group consumer's
        # fetch connection usually holds a long poll (500 ms on Apache Kafka), and a broker
        # answers one connection's requests in order, so every revocation and every leaver's
        # last commit waited for it. The reader's fetches, when it has any, wait 20 ms.
        client = client_of(reader or consumer)
        node = client.get_random_node()
        if node is None:
            return False
        try:
            response = await client.send(
                node, MetadataRequest([self._topic], allow_auto_topic_creation=False)
            )
        except KafkaError as exc:
            # The broker cannot say now; the commit reports what it reports.
            logger.debug("topic check failed", extra=self._log(error=repr(exc)))
            return False
        codes = [t["error_code"] for t in response.to_object()["topics"]]
        if codes != [UnknownTopicOrPartitionError.errno]:
            return False
        self._topic_deleted = True
        logger.error(
            "topic deleted under the running triggerer",
            extra=self._log(topic=self._topic, group=self._group_id),
        )
        self._on_fatal(
            TopicDeletedError(
                f"topic {self._topic} was deleted while the triggerer ran "
                f"(group {self._group_id}); stopping"
            )
        )
        return True
