"""Adjustments to a lane's aiokafka consumer (group leave, fetch wait)."""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.protocol.group import JoinGroupRequest, LeaveGroupRequest

logger = logging.getLogger(__name__)


def _leave_from_generation_zero(consumer: AIOKafkaConsumer) -> None:
    """Make ``consumer.stop()`` leave the group also when its generation is 0.

    aiokafka sends LeaveGroup only from generation > 0 (Kafka numbers generations from 1),
    but Tansu numbers the first generation 0: a member stopped in it would hold its
    partitions until its session timed out instead of handing them over at once.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    original = getattr(coordinator, "_maybe_leave_group", None)
    if coordinator is None or original is None:
        return

    async def leave() -> None:
        if (
            coordinator.generation == 0
            and coordinator.member_id
            and getattr(coordinator, "_group_instance_id", None) is None
        ):
            request = LeaveGroupRequest(coordinator.group_id, coordinator.member_id)
            try:
                await coordinator._send_req(request)
            except KafkaError as exc:
                logger.warning("LeaveGroup failed", extra={"error": repr(exc)})
            coordinator.reset_generation()
            return
        await original()

    coordinator._maybe_leave_group = leave


class _NotSent:
    """Stands for the answer to a JoinGroup that :func:`_join_once` keeps from being sent."""

    error_code = 0


def _join_once(consumer: AIOKafkaConsumer) -> None:
    """Make the consumer send one JoinGroup per join, offering every assignor in it.

    aiokafka 0.14 sends a JoinGroup per configured assignor, each with the protocols listed
    so far (its ``perform_group_join`` has the request loop inside the loop over assignors),
    and keeps only the last answer. With the sticky assignor and round robin (listed for
    rolling upgrades) every join therefore ran two rebalances: the first request completed a
    generation nobody synced, and the second, its protocols changed, started another, which
    every member then joined again (generations went 2, 4, 6...); and two members joining
    together could start a new rebalance with each other's second request, forever (seen:
    generations climbing for minutes, no partition assigned). The requests before the last
    are answered here without being sent; the last one offers every protocol.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    original = getattr(coordinator, "_send_req", None)
    if coordinator is None or original is None:
        return
    offered = len(coordinator._assignors)

    async def send(request: object) -> object:
        if isinstance(request, JoinGroupRequest) and len(request._group_protocols) < offered:
            return _NotSent()
        return await original(request)

    coordinator._send_req = send


def _set_fetch_wait(consumer: AIOKafkaConsumer | None, wait_ms: int) -> None:
    """Change the broker-side wait of the consumer's next fetch requests.

    With a long poll, a partition resumed after its rebuild would wait for the fetch in
    flight (up to the whole wait) before it is fetched: aiokafka sends one fetch per broker
    at a time. While a rebuild runs the lane polls short, so the live tail of the rebuilt
    partitions starts within the short wait.
    """
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is not None and hasattr(fetcher, "_fetch_max_wait_ms"):
        fetcher._fetch_max_wait_ms = wait_ms


async def _learn_topics(reader: AIOKafkaConsumer, topics: list[str]) -> None:
    """Have the rebuild reader's metadata cover ``topics`` before it lists offsets.

    A reader that has not assigned a topic yet holds no metadata for it, and aiokafka
    answers an offsets request for such a partition with a retry after its backoff
    (100 ms), once per topic: 200 ms of every first rebuild. Asking for the topics' metadata
    first costs one round trip. Best effort: without it the offsets request still retries.
    """
    client = getattr(reader, "_client", None)
    set_topics = getattr(client, "set_topics", None)
    if set_topics is None:
        return
    try:
        await set_topics(topics)
    except KafkaError as exc:
        logger.debug("metadata request failed", extra={"error": repr(exc)})
