"""The active-trigger table fold and the checkpoint stores (one contract, two stores)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from deferline.runners.member import RocksPartitionDatabase
from deferline.runners.triggerer.testing import (
    ActiveTriggerTable,
    CheckpointError,
    CheckpointStore,
    MemoryCheckpointStore,
    RocksCheckpointStore,
)
from deferline.topics import LogIdentity, TopicIdentity

TOPIC = "p.defer"


def fold(records: list[tuple[bytes, bytes | None]]) -> ActiveTriggerTable:
    table = ActiveTriggerTable()
    for offset, (key, value) in enumerate(records):
        table.apply(key, value, offset=offset, timestamp=1000 + offset)
    return table


def test_latest_value_per_key_minus_tombstones() -> None:
    table = fold([(b"a", b"1"), (b"b", b"1"), (b"a", b"2"), (b"b", None), (b"c", b"1")])
    assert sorted(table) == [b"a", b"c"]
    entry = table.get(b"a")
    assert entry is not None
    assert (entry.value, entry.offset, entry.timestamp) == (b"2", 2, 1002)
    assert table.defer_offset == 5
    assert table.oldest_timestamp() == 1002


def test_a_key_can_come_back_after_its_tombstone() -> None:
    table = fold([(b"a", b"1"), (b"a", None), (b"a", b"3")])
    entry = table.get(b"a")
    assert entry is not None
    assert entry.value == b"3"


def test_skip_and_advance_move_the_position_only_forward() -> None:
    table = fold([(b"a", b"1")])
    table.skip(7)
    assert table.defer_offset == 8
    table.advance(3)
    assert table.defer_offset == 8
    table.advance(20)
    assert table.defer_offset == 20


def test_take_changes_reports_upserts_and_deletes_once() -> None:
    table = fold([(b"a", b"1"), (b"b", b"1")])
    first = table.take_changes()
    assert set(first.upserts) == {b"a", b"b"}
    assert first.deletes == frozenset()
    assert first.defer_offset == 2
    assert table.take_changes().empty
    table.apply(b"a", None, offset=2)
    table.apply(b"c", b"1", offset=3)
    second = table.take_changes()
    assert set(second.upserts) == {b"c"}
    assert second.deletes == {b"a"}
    assert second.defer_offset == 4


def test_a_key_added_and_deleted_between_checkpoints_is_a_delete() -> None:
    table = fold([(b"a", b"1")])
    table.take_changes()
    table.apply(b"x", b"1", offset=1)
    table.apply(b"x", None, offset=2)
    changes = table.take_changes()
    assert changes.deletes == {b"x"}
    assert not changes.upserts


def test_failed_write_marks_changes_dirty_again() -> None:
    table = fold([(b"a", b"1")])
    changes = table.take_changes()
    table.restore_changes(changes)
    assert set(table.take_changes().upserts) == {b"a"}


def test_resume_offset_stays_below_events_whose_tombstone_is_unread() -> None:
    table = fold([(b"a", b"1"), (b"b", b"1")])
    table.observe_resume_end(10)
    assert table.resume_offset() == 10
    table.note_emitting(b"a")  # queued: it will land at or above 10
    assert table.resume_offset() == 10
    table.note_event_offset(b"a", 14)
    table.note_emitting(b"b")
    table.note_event_offset(b"b", 15)
    assert table.emitting(b"a")
    assert table.resume_offset() == 14
    table.apply(b"a", None, offset=2)  # a's tombstone read back: its event no longer matters
    assert not table.emitting(b"a")
    assert table.resume_offset() == 15
    table.apply(b"b", None, offset=3)
    assert table.resume_offset() == 16


def test_restore_gives_back_the_same_table() -> None:
    table = fold([(b"a", b"1"), (b"b", b"2")])
    changes = table.take_changes()
    restored = ActiveTriggerTable.restore(
        changes.upserts, defer_offset=changes.defer_offset, resume_offset=changes.resume_offset
    )
    assert dict(restored.items()) == dict(table.items())
    assert restored.defer_offset == 2
    assert restored.take_changes().empty


# -- one contract suite, two stores ------------------------------------------------------


@pytest.fixture(params=["memory", "rocksdict"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[], CheckpointStore]]:
    stores: list[CheckpointStore] = []

    def make() -> CheckpointStore:
        store: CheckpointStore
        if request.param == "memory":
            store = stores[0] if stores else MemoryCheckpointStore()
        else:
            store = RocksCheckpointStore(tmp_path / "state")
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_store_round_trips_a_table(make_store: Callable[[], CheckpointStore]) -> None:
    store = make_store()
    assert store.load(TOPIC, 0) is None
    table = fold([(b"a", b"1"), (b"b", b"2"), (b"c", b"3"), (b"b", None)])
    table.observe_resume_end(42)
    store.write(TOPIC, 0, table.take_changes())
    checkpoint = store.load(TOPIC, 0)
    assert checkpoint is not None
    assert (checkpoint.defer_offset, checkpoint.resume_offset) == (4, 42)
    assert dict(checkpoint.entries) == dict(table.items())
    assert store.load(TOPIC, 1) is None


def test_store_applies_incremental_changes(make_store: Callable[[], CheckpointStore]) -> None:
    store = make_store()
    table = fold([(b"a", b"1"), (b"b", b"2")])
    store.write(TOPIC, 3, table.take_changes())
    table.apply(b"a", None, offset=2)
    table.apply(b"d", b"4", offset=3)
    store.write(TOPIC, 3, table.take_changes())
    checkpoint = store.load(TOPIC, 3)
    assert checkpoint is not None
    assert sorted(checkpoint.entries) == [b"b", b"d"]
    assert checkpoint.defer_offset == 4
    assert dict(checkpoint.table().items()) == dict(table.items())


def test_store_survives_release_and_reopen(make_store: Callable[[], CheckpointStore]) -> None:
    store = make_store()
    store.write(TOPIC, 0, fold([(b"a", b"1")]).take_changes())
    store.release(TOPIC, 0)
    store.close()
    again = make_store()
    checkpoint = again.load(TOPIC, 0)
    assert checkpoint is not None
    assert list(checkpoint.entries) == [b"a"]


def test_store_discard_forgets_the_partition(make_store: Callable[[], CheckpointStore]) -> None:
    store = make_store()
    store.write(TOPIC, 0, fold([(b"a", b"1")]).take_changes())
    store.write(TOPIC, 1, fold([(b"b", b"1")]).take_changes())
    store.discard(TOPIC, 0)
    assert store.load(TOPIC, 0) is None
    assert store.load(TOPIC, 1) is not None


def _log_of(topic_id: str) -> LogIdentity:
    return LogIdentity(
        cluster_id="c",
        topics=(TopicIdentity(TOPIC, topic_id, 4),),
        prefix="p.",
        group="p.triggerer",
    )


def test_store_discards_checkpoints_of_another_log_in_one_line(
    make_store: Callable[[], CheckpointStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store()
    store.match_identity(TOPIC, [0, 1, 2], _log_of("a"))
    store.write(TOPIC, 0, fold([(b"a", b"1")]).take_changes())
    store.write(TOPIC, 1, fold([(b"b", b"1")]).take_changes())
    store.match_identity(TOPIC, [0, 1, 2], _log_of("a"))
    assert store.load(TOPIC, 0) is not None, "the same log: kept"
    with caplog.at_level(logging.WARNING):
        store.match_identity(TOPIC, [0, 1, 2], _log_of("b"))
    assert store.load(TOPIC, 0) is None
    assert store.load(TOPIC, 1) is None
    [line] = [r.getMessage() for r in caplog.records if "another log" in r.getMessage()]
    assert "topic id of p.defer: expected b, found a" in line
    assert "partitions [0, 1]" in line
    store.write(TOPIC, 0, fold([(b"c", b"1")]).take_changes())
    store.match_identity(TOPIC, [0], _log_of("b"))
    assert store.load(TOPIC, 0) is not None, "written since: of the new log"


def test_a_checkpoint_without_identity_is_discarded_and_counted(tmp_path: Path) -> None:
    counted: list[int] = []
    store = RocksCheckpointStore(tmp_path, on_mismatch=counted.append)
    try:
        store.write(TOPIC, 0, fold([(b"a", b"1")]).take_changes())  # no identity known yet
        store.match_identity(TOPIC, [0], _log_of("a"))
        assert store.load(TOPIC, 0) is None
        assert counted == [1]
    finally:
        store.close()


def test_a_checkpoint_held_elsewhere_during_the_check_is_checked_when_loaded(
    tmp_path: Path,
) -> None:
    first = RocksCheckpointStore(tmp_path)
    counted: list[int] = []
    second = RocksCheckpointStore(tmp_path, on_mismatch=counted.append)
    try:
        first.match_identity(TOPIC, [0], _log_of("a"))
        first.write(TOPIC, 0, fold([(b"a", b"1")]).take_changes())
        second.match_identity(TOPIC, [0], _log_of("b"))  # held by the first: not read
        assert counted == []
        first.release(TOPIC, 0)
        assert second.load(TOPIC, 0) is None
        assert counted == [1]
    finally:
        first.close()
        second.close()


def test_rocks_store_held_by_another_process_is_a_checkpoint_error(tmp_path: Path) -> None:
    first = RocksCheckpointStore(tmp_path)
    second = RocksCheckpointStore(tmp_path)
    try:
        first.write(TOPIC, 0, fold([(b"a", b"1")]).take_changes())
        with pytest.raises(CheckpointError):
            second.load(TOPIC, 0)
        first.release(TOPIC, 0)
        checkpoint = second.load(TOPIC, 0)
        assert checkpoint is not None
    finally:
        first.close()
        second.close()


def test_rocks_store_ignores_a_checkpoint_of_another_topic(tmp_path: Path) -> None:
    store = RocksCheckpointStore(tmp_path)
    try:
        store.write(TOPIC, 0, fold([(b"a", b"1")]).take_changes())
        store.release(TOPIC, 0)
        (tmp_path / "other").symlink_to(tmp_path / TOPIC)
        assert store.load("other", 0) is None
    finally:
        store.close()


class _CountedWrites:
    """A rocksdict database that counts its writes; the ``fail_at``-th raises (those before
    it land)."""

    def __init__(self, db: Any, fail_at: int | None = None) -> None:
        self._db = db
        self._fail_at = fail_at
        self.writes = 0

    def write(self, batch: Any) -> None:
        self.writes += 1
        if self.writes == self._fail_at:
            raise OSError("disk full")
        self._db.write(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _log(seed: int, n: int) -> list[tuple[bytes, bytes | None]]:
    """Deferrals, re-deferrals and tombstones over a few hundred trigger ids."""
    rng = random.Random(seed)
    return [
        (f"t{rng.randrange(300)}".encode(), None if rng.random() < 0.3 else rng.randbytes(200))
        for _ in range(n)
    ]


@pytest.mark.parametrize("fail_at", [2, 5, 9])
def test_a_checkpoint_interrupted_between_batches_reads_on_to_the_same_table(
    tmp_path: Path, fail_at: int
) -> None:
    log = _log(fail_at, 3000)
    db = RocksPartitionDatabase(tmp_path / "0", batch_bytes=4096)
    store = CheckpointStore(lambda topic, partition: db)
    try:
        table = fold(log[:1000])
        store.write(TOPIC, 0, table.take_changes())
        before = store.load(TOPIC, 0)
        assert before is not None
        for offset in range(1000, len(log)):
            key, value = log[offset]
            table.apply(key, value, offset=offset, timestamp=1000 + offset)
        db._db = _CountedWrites(db._db, fail_at)
        with pytest.raises(CheckpointError, match="disk full"):
            store.write(TOPIC, 0, table.take_changes())
        interrupted = store.load(TOPIC, 0)
        assert interrupted is not None
        # the positions are the previous checkpoint's, the entries partly newer
        assert interrupted.defer_offset == before.defer_offset == 1000
        assert dict(interrupted.entries) != dict(before.entries)
        restored = interrupted.table()
        for offset in range(restored.defer_offset, len(log)):
            key, value = log[offset]
            restored.apply(key, value, offset=offset, timestamp=1000 + offset)
        assert dict(restored.items()) == dict(table.items())
    finally:
        store.close()


def test_a_large_checkpoint_is_written_in_bounded_batches(tmp_path: Path) -> None:
    db = RocksPartitionDatabase(tmp_path / "0", batch_bytes=4096)
    store = CheckpointStore(lambda topic, partition: db)
    try:
        table = fold([(f"t{i}".encode(), bytes(500)) for i in range(100)])
        counting = db._db = _CountedWrites(db._db)
        store.write(TOPIC, 0, table.take_changes())
        assert counting.writes >= 100 * 500 // 4096  # about eight entries per batch
        checkpoint = store.load(TOPIC, 0)
        assert checkpoint is not None
        assert dict(checkpoint.entries) == dict(table.items())
    finally:
        store.close()
