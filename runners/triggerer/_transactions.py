"""Transactional producers, one per owned defer partition, where the broker has transactions.

On Apache Kafka the events of defer partition *p* of a trigger queue are written under the
``transactional.id`` ``<group>.<p>`` (``<group>``: that queue's triggerer group), the same
id on every member: the member that acquires *p* starts its producer before it reads the
resume topic back, which aborts the previous owner's open transaction and bumps the
producer epoch. From then on a paused old owner's writes for *p* are rejected (fenced), and
every event, its tasks.events copy and its tombstone commit in one transaction (see
:class:`~._emitter.Emitter`): the copy is written exactly once. Brokers without
transactions (Tansu) get none: the shared producer writes the event, the copy, then the
tombstone, at least once, and the scheduler drops repeats by event id.
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaProducer
from aiokafka.errors import UnknownError, UnsupportedVersionError
from deferline.topics import Settings, make_producer, start_client, stop_client

from .._aiokafka import abort_reaches_the_broker
from ._lane_types import TriggererError

__all__ = ["PartitionProducers", "transactional_id"]

logger = logging.getLogger(__name__)


def transactional_id(group_id: str, partition: int) -> str:
    """The transactional id of defer partition ``partition`` of the group ``group_id``."""
    return f"{group_id}.{partition}"


class PartitionProducers:
    """Starts and stops the transactional producers of the partitions a member acquires.

    Args:
        settings: connection settings.
        transactions: write in transactions (True: a broker without them is an error),
            never (False), or when the broker has them (None: found out at the first start).
        client_id: the producers' client id (the member's name).
    """

    def __init__(self, settings: Settings, *, transactions: bool | None, client_id: str) -> None:
        self.settings = settings
        self.enabled = transactions
        """True once a producer started in transactions; False: none are used."""
        self._required = transactions is True
        self._client_id = client_id

    async def start(self, transactional_id: str) -> AIOKafkaProducer | None:
        """The started producer of ``transactional_id`` (the previous owner is fenced from
        here on); None where no transactions are used."""
        if self.enabled is False:
            return None
        producer = make_producer(
            self.settings,
            client_id=self._client_id,
            transactional_id=transactional_id,
            enable_idempotence=True,
            # Records are handed over in batches per partition: lingering only delays the
            # commit.
            linger_ms=0,
            max_batch_size=256 * 1024,
            # The broker answers CONCURRENT_TRANSACTIONS while it writes the previous
            # commit's markers; aiokafka waits this long before asking again (100 ms by
            # default). The Java client waits 20 ms.
            retry_backoff_ms=20,
        )
        abort_reaches_the_broker(producer)
        try:
            await start_client(producer, grace=5.0, name="partition producer")
        except (UnknownError, UnsupportedVersionError) as exc:
            if self._required:
                raise TriggererError(f"the broker has no transactions: {exc}") from exc
            if self.enabled is None:
                logger.warning(
                    "broker has no transactions: events are written at least once (the "
                    "scheduler drops repeats by event id; a paused old owner is not fenced)",
                    extra={"transactional_id": transactional_id},
                )
            self.enabled = False
            return None
        self.enabled = True
        return producer

    async def stop(self, producer: AIOKafkaProducer) -> None:
        """Close a partition's producer (bounded: the broker may be gone)."""
        await stop_client(producer, grace=5.0, name="partition producer")
