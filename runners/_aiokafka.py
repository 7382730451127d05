"""Every aiokafka internal the runners touch, in one place, each checked where it is used.

aiokafka gives no public door for these (a consumer's group coordinator, its fetcher, its
client), and a minor release may rename or drop any of them: each use here states what it
needs and fails loudly (:class:`AiokafkaInternalsError`) when it is missing, rather than
quietly doing nothing. ``tests/runners/test_aiokafka_shim.py`` holds one contract test per
internal against the installed aiokafka.
"""

from __future__ import annotations

import logging
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import KafkaError
from aiokafka.protocol.group import JoinGroupRequest, LeaveGroupRequest
from deferline.schemas import DeferlineError

__all__ = [
    "AiokafkaInternalsError",
    "client_of",
    "group_generation",
    "join_once",
    "leave_from_generation_zero",
    "request_rejoin",
    "set_fetch_wait",
]

logger = logging.getLogger(__name__)


class AiokafkaInternalsError(DeferlineError):
    """The installed aiokafka lacks an internal deferline relies on (a release changed it)."""


def _internal(owner: object, name: str) -> Any:
    """``owner.name``, or a loud error naming what is missing."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise AiokafkaInternalsError(
            f"aiokafka changed: {type(owner).__name__} has no {name!r}"
        ) from None


def client_of(consumer: Any) -> AIOKafkaClient:
    """The network client of a consumer (metadata requests, metadata refreshes)."""
    client: AIOKafkaClient = _internal(consumer, "_client")
    return client


def group_generation(consumer: AIOKafkaConsumer) -> int:
    """The group generation the consumer joined last (-1 before the first join)."""
    return int(_internal(_internal(consumer, "_coordinator"), "generation"))


def request_rejoin(consumer: AIOKafkaConsumer) -> None:
    """Make the consumer rejoin its group at its next poll (a rebalance follows): the
    member learned that it lost a partition the group still lists as its own."""
    _internal(_internal(consumer, "_coordinator"), "request_rejoin")()


def set_fetch_wait(consumer: AIOKafkaConsumer, wait_ms: int) -> None:
    """Change the broker-side wait of the consumer's next fetch requests.

    With a long poll, a partition resumed after its rebuild would wait for the fetch in
    flight (up to the whole wait) before it is fetched: aiokafka sends one fetch per broker
    at a time. While a rebuild runs the lane polls short, so the live tail of the rebuilt
    partitions starts within the short wait.
    """
    fetcher = _internal(consumer, "_fetcher")
    _internal(fetcher, "_fetch_max_wait_ms")
    fetcher._fetch_max_wait_ms = wait_ms


def leave_from_generation_zero(consumer: AIOKafkaConsumer) -> None:
    """Make ``consumer.stop()`` leave the group also when its generation is 0.

    aiokafka sends LeaveGroup only from generation > 0 (Kafka numbers generations from 1),
    but Tansu numbers the first generation 0: a member stopped in it would hold its
    partitions until its session timed out instead of handing them over at once.
    """
    coordinator = _internal(consumer, "_coordinator")
    original = _internal(coordinator, "_maybe_leave_group")
    for name in ("generation", "member_id", "group_id", "_group_instance_id", "_send_req"):
        _internal(coordinator, name)
    _internal(coordinator, "reset_generation")

    async def leave() -> None:
        if (
            coordinator.generation == 0
            and coordinator.member_id
            and coordinator._group_instance_id is None
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
    """Stands for the answer to a JoinGroup that :func:`join_once` keeps from being sent."""

    error_code = 0


def join_once(consumer: AIOKafkaConsumer) -> None:
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
    coordinator = _internal(consumer, "_coordinator")
    original = _internal(coordinator, "_send_req")
    offered = len(_internal(coordinator, "_assignors"))

    async def send(request: object) -> object:
        if isinstance(request, JoinGroupRequest) and len(request._group_protocols) < offered:
            return _NotSent()
        return await original(request)

    coordinator._send_req = send
