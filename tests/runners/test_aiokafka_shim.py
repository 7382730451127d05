"""One contract test per aiokafka internal that ``deferline.runners._aiokafka`` relies on.

Each test reads the internal off the installed aiokafka (a consumer built, not started, or
the class that owns it), so a release that renames or drops one fails here, by name, and
not in a rebalance in production. The shim itself fails loudly on what is missing.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.consumer.fetcher import Fetcher
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.protocol.group import JoinGroupRequest
from deferline.runners.testing import (
    AiokafkaInternalsError,
    GenerationTxnOffsetCommit,
    GroupMetadata,
    StableOffsetFetch,
    abort_reaches_the_broker,
    admin_client,
    client_of,
    commit_offsets_with_generation,
    group_generation,
    join_once,
    leave_from_generation_zero,
    set_fetch_wait,
)


def _assigned_in_init(cls: type, attribute: str) -> bool:
    return f"self.{attribute} =" in inspect.getsource(cls.__init__)  # type: ignore[misc]


async def test_a_consumer_holds_its_client_as_client() -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers="unused:9092")
    try:
        assert isinstance(client_of(consumer), AIOKafkaClient)
    finally:
        await consumer.stop()


def test_the_client_offers_the_metadata_calls_the_runners_make() -> None:
    for name in ("set_topics", "force_metadata_update", "fetch_all_metadata"):
        assert callable(getattr(AIOKafkaClient, name)), name
    for name in ("get_random_node", "send"):
        assert callable(getattr(AIOKafkaClient, name)), name


def test_a_consumer_keeps_its_coordinator_and_fetcher() -> None:
    source = inspect.getsource(AIOKafkaConsumer.start)
    assert "self._coordinator =" in source
    assert "self._fetcher =" in source


def test_the_coordinator_keeps_generation_member_and_assignors() -> None:
    for attribute in ("generation", "member_id", "group_id", "_group_instance_id", "_assignors"):
        assert _assigned_in_init(GroupCoordinator, attribute), attribute


def test_the_coordinator_can_be_asked_to_rejoin() -> None:
    assert callable(GroupCoordinator.request_rejoin)
    assert inspect.signature(GroupCoordinator.request_rejoin).parameters.keys() == {"self"}


def test_the_coordinator_sends_through_send_req_and_leaves_through_maybe_leave_group() -> None:
    for name in ("_send_req", "_maybe_leave_group", "reset_generation"):
        assert inspect.iscoroutinefunction(getattr(GroupCoordinator, name)) or callable(
            getattr(GroupCoordinator, name)
        ), name
    assert "self._maybe_leave_group()" in inspect.getsource(GroupCoordinator)


def test_the_fetcher_reads_its_wait_from_fetch_max_wait_ms() -> None:
    assert _assigned_in_init(Fetcher, "_fetch_max_wait_ms")
    assert "self._fetch_max_wait_ms" in inspect.getsource(Fetcher._get_actions_per_node)


def test_a_joingroup_request_lists_its_protocols_as_group_protocols() -> None:
    request = JoinGroupRequest("g", 10_000, 30_000, "", None, "consumer", [("sticky", b"")])
    assert request._group_protocols == [("sticky", b"")]


def test_the_shim_reads_the_generation_of_a_joined_consumer() -> None:
    consumer = SimpleNamespace(_coordinator=SimpleNamespace(generation=7))
    assert group_generation(cast(AIOKafkaConsumer, consumer)) == 7


def test_the_shim_sets_the_fetch_wait() -> None:
    fetcher = SimpleNamespace(_fetch_max_wait_ms=500)
    set_fetch_wait(cast(AIOKafkaConsumer, SimpleNamespace(_fetcher=fetcher)), 20)
    assert fetcher._fetch_max_wait_ms == 20


@pytest.mark.parametrize(
    "adjust",
    [join_once, leave_from_generation_zero, set_fetch_wait, group_generation, client_of],
)
def test_a_missing_internal_fails_loudly(adjust: Any) -> None:
    consumer = cast(AIOKafkaConsumer, SimpleNamespace())
    args = (20,) if adjust is set_fetch_wait else ()
    with pytest.raises(AiokafkaInternalsError, match="aiokafka changed"):
        adjust(consumer, *args)


def test_the_coordinator_keeps_group_and_instance_ids() -> None:
    for attribute in ("group_id", "_group_instance_id"):
        assert _assigned_in_init(GroupCoordinator, attribute), attribute


async def test_a_transactional_producer_commits_offsets_through_its_sender() -> None:
    """What ``commit_offsets_with_generation`` replaces and reads: the sender's offset-commit
    step, its transaction manager and coordinator lookup, aiokafka's v0 handler to extend."""
    from aiokafka.producer import sender

    producer = AIOKafkaProducer(bootstrap_servers="unused:9092", transactional_id="t")
    try:
        commit_offsets_with_generation(producer, lambda: GroupMetadata("g", 3, "m"))
        assert producer._sender._do_txn_offset_commit.__name__ == "commit"
        txn_manager = producer._sender._txn_manager
        for name in ("transactional_id", "producer_id", "producer_epoch", "_transition_to"):
            assert hasattr(txn_manager, name), name
        for name in ("_pending_txn_offsets", "_transaction_waiter", "_txn_partitions"):
            assert name in vars(txn_manager), name
        handler = sender.TxnOffsetCommitHandler
        assert {"create_request", "handle_response"} <= set(vars(handler)), "overridden"
        assert "self._offsets = offsets" in inspect.getsource(handler.__init__)
    finally:
        await producer.stop()


def test_the_kip447_requests_encode_as_their_versions() -> None:
    """TxnOffsetCommit v3 and OffsetFetch v7: flexible, the versions KIP-447 added the group
    metadata and ``require_stable`` in."""
    from aiokafka.structs import OffsetAndMetadata

    tp = TopicPartition("t", 1)
    commit = GenerationTxnOffsetCommit(
        "txn", 7, 2, GroupMetadata("g", 3, "m", "i"), {tp: OffsetAndMetadata(5, "")}
    ).prepare({28: (0, 4)})
    assert (commit.API_VERSION, commit.FLEXIBLE_VERSION) == (3, True)
    assert commit.to_object()["generation_id"] == 3
    fetch = StableOffsetFetch("g", [tp]).prepare({9: (0, 9)})
    assert (fetch.API_VERSION, fetch.to_object()["require_stable"]) == (7, True)
    assert isinstance(commit.encode(), bytes)
    assert isinstance(fetch.encode(), bytes)


async def test_an_admin_client_holds_its_network_client_as_client() -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers="unused:9092")
    try:
        assert isinstance(admin_client(admin), AIOKafkaClient)
        assert callable(AIOKafkaClient.coordinator_lookup)
    finally:
        await admin.close()


async def test_a_failed_transaction_keeps_what_its_abort_must_end() -> None:
    """aiokafka's ``error_transaction`` forgets the partitions the broker added to the
    transaction, so its abort sends no EndTxn; with ``abort_reaches_the_broker`` the added
    ones stay (the abort ends them) and those not added yet are dropped."""
    from aiokafka.errors import KafkaError
    from aiokafka.producer.transaction_manager import TransactionResult

    added, pending = TopicPartition("t", 0), TopicPartition("t", 1)
    for guarded in (False, True):
        producer = AIOKafkaProducer(bootstrap_servers="unused:9092", transactional_id="t")
        try:
            if guarded:
                abort_reaches_the_broker(producer)
            txn = producer._sender._txn_manager
            txn.set_pid_and_epoch(5, 0)
            txn.begin_transaction()
            txn.maybe_add_partition_to_txn(added)
            txn.partition_added(added)
            txn.maybe_add_partition_to_txn(pending)
            txn.error_transaction(KafkaError("refused"))
            assert txn.partitions_to_add() == set()
            assert txn.is_empty_transaction() is not guarded, (
                "guarded, the abort has a partition to end" if guarded else "aiokafka's own"
            )
            with pytest.raises(KafkaError, match="refused"):
                txn.committing_transaction()  # only an abort goes on
            txn.aborting_transaction()
            assert txn.needs_transaction_commit() is TransactionResult.ABORT
        finally:
            await producer.stop()
