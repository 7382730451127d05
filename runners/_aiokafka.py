"""Every aiokafka internal the runners touch, in one place, each checked where it is used.

aiokafka gives no public door for these (a consumer's group coordinator, its fetcher, its
client), and a minor release may rename or drop any of them: each use here states what it
needs and fails loudly (:class:`AiokafkaInternalsError`) when it is missing, rather than
quietly doing nothing. ``tests/runners/test_aiokafka_shim.py`` holds one contract test per
internal against the installed aiokafka.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.client import AIOKafkaClient, CoordinationType
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    IllegalGenerationError,
    KafkaError,
    UnknownMemberIdError,
    for_code,
)
from aiokafka.producer import sender as aiokafka_sender
from aiokafka.producer.transaction_manager import TransactionState
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.commit import OffsetCommitRequest
from aiokafka.protocol.group import JoinGroupRequest, LeaveGroupRequest
from aiokafka.protocol.types import (
    Boolean,
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Int64,
    Schema,
    TaggedFields,
)
from deferline.schemas import DeferlineError

__all__ = [
    "AiokafkaInternalsError",
    "FencedByGroup",
    "GroupMetadata",
    "UnstableOffsets",
    "abort_reaches_the_broker",
    "admin_client",
    "client_of",
    "commit_offsets_as_no_member",
    "commit_offsets_with_generation",
    "fetch_stable_offsets",
    "group_generation",
    "group_metadata",
    "join_once",
    "leave_from_generation_zero",
    "offsets_of_several_groups",
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


# -- KIP-447: offsets committed in a transaction with the group's generation ----------------


@dataclass(frozen=True, slots=True)
class GroupMetadata:
    """A consumer's place in its group, which a transaction's offset commit carries (KIP-447):
    the group coordinator refuses the commit of a member no longer in the current generation,
    so a zombie's transaction fails and is aborted."""

    group_id: str
    generation: int
    member_id: str
    group_instance_id: str | None = None


def group_metadata(consumer: AIOKafkaConsumer) -> GroupMetadata:
    """The consumer's group, generation, member id and static instance id, as it joined last."""
    coordinator = _internal(consumer, "_coordinator")
    return GroupMetadata(
        group_id=str(_internal(coordinator, "group_id")),
        generation=int(_internal(coordinator, "generation")),
        member_id=str(_internal(coordinator, "member_id")),
        group_instance_id=_internal(coordinator, "_group_instance_id"),
    )


class FencedByGroup(DeferlineError):
    """The group coordinator refused a transaction's offsets: the member is no longer in the
    generation it committed for (a rebalance went on without it). Abort the transaction."""


class UnstableOffsets(DeferlineError):
    """Offsets of the group are pending in an open transaction (``require_stable``): ask again
    once it has ended."""


_ABORTABLE_ERROR = TransactionState.ABORTABLE_ERROR

# Error codes aiokafka 0.14 has no class for.
_FENCED_INSTANCE_ID = 82
_UNSTABLE_OFFSET_COMMIT = 88
_FENCING = frozenset(
    {IllegalGenerationError.errno, UnknownMemberIdError.errno, _FENCED_INSTANCE_ID}
)


class _TxnOffsetCommitResponse_v3(Response):  # type: ignore[misc]  # aiokafka is untyped here
    API_KEY = 28
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                (
                    "partitions",
                    CompactArray(
                        ("partition", Int32), ("error_code", Int16), ("tags", TaggedFields)
                    ),
                ),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _TxnOffsetCommitRequest_v3(RequestStruct):  # type: ignore[misc]  # aiokafka is untyped
    FLEXIBLE_VERSION = True
    API_KEY = 28
    API_VERSION = 3
    RESPONSE_TYPE = _TxnOffsetCommitResponse_v3
    SCHEMA = Schema(
        ("transactional_id", CompactString("utf-8")),
        ("group_id", CompactString("utf-8")),
        ("producer_id", Int64),
        ("producer_epoch", Int16),
        ("generation_id", Int32),
        ("member_id", CompactString("utf-8")),
        ("group_instance_id", CompactString("utf-8")),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                (
                    "partitions",
                    CompactArray(
                        ("partition", Int32),
                        ("committed_offset", Int64),
                        ("committed_leader_epoch", Int32),
                        ("committed_metadata", CompactString("utf-8")),
                        ("tags", TaggedFields),
                    ),
                ),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _GenerationTxnOffsetCommit(Request[_TxnOffsetCommitRequest_v3]):  # type: ignore[misc]
    """TxnOffsetCommit v3 with the group metadata; a broker without it (no KIP-447, before
    Kafka 2.5) cannot take it (IncompatibleBrokerVersion)."""

    API_KEY = 28

    def __init__(
        self,
        transactional_id: str,
        producer_id: int,
        producer_epoch: int,
        member: GroupMetadata,
        offsets: Mapping[TopicPartition, Any],
    ) -> None:
        self._fields = (transactional_id, member.group_id, producer_id, producer_epoch)
        self._member = member
        by_topic: dict[str, list[tuple[int, int, int, str, dict[int, bytes]]]] = {}
        for tp, offset in sorted(offsets.items()):
            by_topic.setdefault(tp.topic, []).append(
                (tp.partition, offset.offset, -1, offset.metadata, {})
            )
        self._topics: list[tuple[str, list[Any], dict[int, bytes]]] = [
            (topic, partitions, {}) for topic, partitions in by_topic.items()
        ]

    def build(
        self, request_struct_class: type[_TxnOffsetCommitRequest_v3]
    ) -> _TxnOffsetCommitRequest_v3:
        member = self._member
        return request_struct_class(
            *self._fields,
            member.generation,
            member.member_id,
            member.group_instance_id,
            self._topics,
            {},
        )


def _refuse_transaction(txn_manager: Any, error: BaseException) -> None:
    """Fail the open transaction so that it can only be aborted, as aiokafka's
    ``error_transaction`` does, but keep the partitions and group the broker has added to it.

    ``error_transaction`` forgets them; its abort then counts as empty and sends no EndTxn, so
    the broker's transaction stays open and the producer's next transaction, begun on the
    client alone, writes into it: its commit commits the refused records too. Kept, the abort
    sends EndTxn(ABORT). (Partitions not added yet are dropped, as aiokafka drops them: the
    broker holds nothing of theirs, and one refused for good must not be asked again.)"""
    _internal(txn_manager, "_transition_to")(_ABORTABLE_ERROR)
    _internal(txn_manager, "_pending_txn_partitions").clear()
    pending = _internal(txn_manager, "_pending_txn_offsets")
    for _, _, waiting in pending:
        if not waiting.done():
            waiting.set_exception(error)
    pending.clear()
    waiter = _internal(txn_manager, "_transaction_waiter")
    if waiter is not None and not waiter.done():
        waiter.set_exception(error)  # a commit now raises it; only an abort goes on
        waiter.exception()  # retrieved: the abort replaces the waiter, which nobody awaits


def abort_reaches_the_broker(producer: AIOKafkaProducer) -> None:
    """Make every failure of the transactional ``producer``'s transactions abortable at the
    broker: aiokafka's ``error_transaction`` (called on a refused AddPartitionsToTxn,
    AddOffsetsToTxn or offset commit) is replaced by :func:`_refuse_transaction`. Call once,
    before its first transaction."""
    txn_manager = _internal(_internal(producer, "_sender"), "_txn_manager")
    _internal(txn_manager, "error_transaction")
    txn_manager.error_transaction = lambda error: _refuse_transaction(txn_manager, error)


def offsets_of_several_groups(producer: AIOKafkaProducer) -> None:
    """Let one transaction of the transactional ``producer`` commit offsets for several
    consumer groups (``send_offsets_to_transaction`` once per group), as the protocol allows.

    aiokafka adds only the first group to a transaction (AddOffsetsToTxn) and then sends every
    later group's offsets unadded: the coordinator refuses them (INVALID_TXN_STATE) and the
    producer is in a fatal error for good. Here each group waiting in line is added before
    its offsets are sent. Call once, before the producer's first transaction."""
    txn_manager = _internal(_internal(producer, "_sender"), "_txn_manager")
    pending: Any = _internal(txn_manager, "_pending_txn_offsets")
    begin = _internal(txn_manager, "begin_transaction")
    _internal(txn_manager, "consumer_group_added")
    added: set[str] = set()

    def begin_transaction() -> None:
        added.clear()
        begin()

    def consumer_group_to_add() -> str | None:
        for group_id, _, _ in pending:  # the first in line only: they go in order
            return None if group_id in added else str(group_id)
        return None

    def offsets_to_commit() -> tuple[Any, str] | None:
        for group_id, offsets, _ in pending:
            return (offsets, group_id) if group_id in added else None
        return None

    def consumer_group_added(group_id: str) -> None:
        added.add(group_id)
        txn_manager._txn_consumer_group = group_id  # the transaction is not empty: EndTxn

    txn_manager.begin_transaction = begin_transaction
    txn_manager.consumer_group_to_add = consumer_group_to_add
    txn_manager.offsets_to_commit = offsets_to_commit
    txn_manager.consumer_group_added = consumer_group_added


def commit_offsets_with_generation(
    producer: AIOKafkaProducer, member: Callable[[], GroupMetadata]
) -> None:
    """Make the transactional ``producer`` commit offsets (``send_offsets_to_transaction``)
    with TxnOffsetCommit v3, carrying ``member()`` (read at each commit) instead of aiokafka's
    v0, which carries no generation (KIP-447). Offsets of any other group than ``member()``'s
    go in as a standalone consumer's (generation -1, no member id).

    A commit the coordinator refuses for the generation (ILLEGAL_GENERATION,
    UNKNOWN_MEMBER_ID, FENCED_INSTANCE_ID) fails the transaction: ``send_offsets_to_transaction``
    raises :class:`FencedByGroup`, and the transaction can only be aborted (which reaches
    the broker: see :func:`_refuse_transaction`). Other answers are
    handled as aiokafka handles v0's. Call once, before the producer's first transaction.
    """
    sender = _internal(producer, "_sender")
    txn_manager = _internal(sender, "_txn_manager")
    find_coordinator = _internal(sender, "_find_coordinator")
    _internal(sender, "_do_txn_offset_commit")
    base: Any = _internal(aiokafka_sender, "TxnOffsetCommitHandler")

    class _Handler(base):  # type: ignore[misc]
        def create_request(self) -> _GenerationTxnOffsetCommit:
            return _GenerationTxnOffsetCommit(
                txn_manager.transactional_id,
                txn_manager.producer_id,
                txn_manager.producer_epoch,
                self._metadata,
                self._offsets,
            )

        def handle_response(self, resp: Any) -> Any:
            fenced = [
                (topic, partition, code)
                for topic, partitions, _ in resp.topics
                for partition, code, _ in partitions
                if code in _FENCING
            ]
            if fenced:
                topic, partition, code = fenced[0]
                _refuse_transaction(
                    txn_manager,
                    FencedByGroup(
                        f"the group coordinator refused the offsets of {topic}[{partition}] "
                        f"for generation {self._metadata.generation} (error {code}): this "
                        "member is no longer in the group's current generation"
                    ),
                )
                return None
            resp.errors = [
                (topic, [(partition, code) for partition, code, _ in partitions])
                for topic, partitions, _ in resp.topics
            ]
            return super().handle_response(resp)

    async def commit(offsets: Mapping[TopicPartition, Any], group_id: str) -> None:
        if not offsets:
            return
        try:
            node_id = await find_coordinator(CoordinationType.GROUP, group_id)
        except GroupAuthorizationFailedError as exc:
            _refuse_transaction(txn_manager, exc)
            return
        handler = _Handler(sender, offsets, group_id)
        metadata = member()
        # Another group's offsets (a source topic's reader, not a member of it) go in as a
        # standalone consumer's: no generation, no member id.
        handler._metadata = (
            metadata if metadata.group_id == group_id else GroupMetadata(group_id, -1, "")
        )
        await handler.do(node_id)

    sender._do_txn_offset_commit = commit


class _OffsetFetchResponse_v7(Response):  # type: ignore[misc]  # aiokafka is untyped here
    API_KEY = 9
    API_VERSION = 7
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                (
                    "partitions",
                    CompactArray(
                        ("partition", Int32),
                        ("committed_offset", Int64),
                        ("committed_leader_epoch", Int32),
                        ("metadata", CompactString("utf-8")),
                        ("error_code", Int16),
                        ("tags", TaggedFields),
                    ),
                ),
                ("tags", TaggedFields),
            ),
        ),
        ("error_code", Int16),
        ("tags", TaggedFields),
    )


class _OffsetFetchRequest_v7(RequestStruct):  # type: ignore[misc]  # aiokafka is untyped here
    FLEXIBLE_VERSION = True
    API_KEY = 9
    API_VERSION = 7
    RESPONSE_TYPE = _OffsetFetchResponse_v7
    SCHEMA = Schema(
        ("group_id", CompactString("utf-8")),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                ("partitions", CompactArray(Int32)),
                ("tags", TaggedFields),
            ),
        ),
        ("require_stable", Boolean),
        ("tags", TaggedFields),
    )


class _StableOffsetFetch(Request[_OffsetFetchRequest_v7]):  # type: ignore[misc]
    """OffsetFetch v7 with ``require_stable`` (KIP-447; Kafka 2.5+)."""

    API_KEY = 9

    def __init__(self, group_id: str, partitions: Sequence[TopicPartition]) -> None:
        self._group_id = group_id
        by_topic: dict[str, list[int]] = {}
        for tp in partitions:
            by_topic.setdefault(tp.topic, []).append(tp.partition)
        self._topics: list[tuple[str, list[int], dict[int, bytes]]] = [
            (topic, sorted(ps), {}) for topic, ps in sorted(by_topic.items())
        ]

    def build(self, request_struct_class: type[_OffsetFetchRequest_v7]) -> _OffsetFetchRequest_v7:
        return request_struct_class(self._group_id, self._topics, True, {})


def admin_client(admin: Any) -> AIOKafkaClient:
    """The network client of an admin client (its requests aiokafka's admin API lacks)."""
    client: AIOKafkaClient = _internal(admin, "_client")
    return client


async def commit_offsets_as_no_member(
    client: AIOKafkaClient, group_id: str, offsets: Mapping[TopicPartition, int]
) -> None:
    """Commit ``offsets`` for ``group_id`` as a member of no generation (OffsetCommit with
    generation -1 and no member id): what a reader with manual assignment commits, without
    a consumer assigned those partitions. Raises the first partition's error."""
    topics: dict[str, list[tuple[int, int, str]]] = {}
    for tp, offset in sorted(offsets.items()):
        topics.setdefault(tp.topic, []).append((tp.partition, offset, ""))
    node_id = await client.coordinator_lookup(CoordinationType.GROUP, group_id)
    request = OffsetCommitRequest(
        group_id,
        OffsetCommitRequest.DEFAULT_GENERATION_ID,
        "",
        OffsetCommitRequest.DEFAULT_RETENTION_TIME,
        list(topics.items()),
    )
    response = await client.send(node_id, request)
    for topic, partitions in response.topics:
        for partition, code in partitions:
            if code:
                raise for_code(code)(f"OffsetCommit of {topic}[{partition}] for group {group_id}")


async def fetch_stable_offsets(
    client: AIOKafkaClient, group_id: str, partitions: Sequence[TopicPartition]
) -> dict[TopicPartition, int | None]:
    """The committed offsets of ``group_id`` for ``partitions`` (None: none committed), never
    one an open transaction is still committing: :class:`UnstableOffsets` then (KIP-447's
    ``require_stable``; a new owner asks again rather than read past a zombie's offsets)."""
    node_id = await client.coordinator_lookup(CoordinationType.GROUP, group_id)
    response = await client.send(node_id, _StableOffsetFetch(group_id, partitions))
    if response.error_code == _UNSTABLE_OFFSET_COMMIT:
        raise UnstableOffsets(f"offsets of group {group_id} are pending in a transaction")
    if response.error_code:
        raise for_code(response.error_code)(f"OffsetFetch of group {group_id}")
    found: dict[TopicPartition, int | None] = dict.fromkeys(partitions)
    for topic, topic_partitions, _ in response.topics:
        for partition, offset, _epoch, _metadata, code, _ in topic_partitions:
            if code == _UNSTABLE_OFFSET_COMMIT:
                raise UnstableOffsets(
                    f"the offset of {topic}[{partition}] for group {group_id} is pending in a "
                    "transaction"
                )
            if code:
                raise for_code(code)(f"OffsetFetch of {topic}[{partition}]")
            found[TopicPartition(topic, partition)] = None if offset < 0 else offset
    return found
