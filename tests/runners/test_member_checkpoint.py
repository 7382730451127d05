"""One contract for a member's partition checkpoint: rows and the header that says what they
reflect and which log they were read from, written header last, and refused (with the
reason) when of another format, topic, partition or log. Run against every partition
database; then the refusals as each role meets them: discarded, one line per reason, those
of another log counted."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.engine import TaskTable
from deferline.runners.member import (
    CHECKPOINT_FORMAT,
    ROW_PREFIX,
    CheckpointHeader,
    CheckpointUnusable,
    DiscardedCheckpoints,
    MemberCheckpoint,
    MemoryPartitionDatabase,
    PartitionDatabase,
    RocksPartitionDatabase,
)
from deferline.runners.scheduler.testing import Checkpoints, TaskFold
from deferline.runners.testing import CheckpointError
from deferline.runners.triggerer.testing import (
    ActiveTriggerTable,
    Checkpointer,
    CheckpointStore,
    OwnedPartition,
    Span,
    TriggererMetrics,
)
from deferline.topics import LogIdentity, TopicIdentity, compare_identity
from prometheus_client import CollectorRegistry

TOPIC = "p.defer"


def _log_of(topic: str, topic_id: str) -> LogIdentity:
    return LogIdentity(
        cluster_id="c", topics=(TopicIdentity(topic, topic_id, 4),), prefix="p.", group="p.g"
    )


LOG_A, LOG_B = _log_of(TOPIC, "a"), _log_of(TOPIC, "b")


# -- the checkpoint, over every partition database ----------------------------------------


class Databases:
    """Opens one partition's database, closing the one opened before (a reopen sees what was
    written). ``rocks-batched`` writes in batches of 16 bytes: rows land before the header
    does."""

    def __init__(self, kind: str, path: Path) -> None:
        self.kind = kind
        self._path = path
        self._memory = MemoryPartitionDatabase("p.defer/0 in memory")
        self._open: list[PartitionDatabase] = []

    def open(self) -> PartitionDatabase:
        self.close()
        db: PartitionDatabase
        if self.kind == "memory":
            db = self._memory
        else:
            db = RocksPartitionDatabase(
                self._path, batch_bytes=16 if self.kind == "rocks-batched" else None
            )
        self._open.append(db)
        return db

    def checkpoint(self, *, partition: int = 0, topic: str = TOPIC) -> MemberCheckpoint:
        return MemberCheckpoint(self.open(), topic=topic, partition=partition)

    def close(self) -> None:
        opened, self._open = self._open, []
        for db in opened:
            db.close()


@pytest.fixture(params=["memory", "rocks", "rocks-batched"])
def databases(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Databases]:
    found = Databases(request.param, tmp_path / "p.defer" / "0")
    yield found
    found.close()


def _rows(checkpoint: MemberCheckpoint) -> dict[bytes, bytes]:
    return {key[len(ROW_PREFIX) :]: value for key, value in checkpoint.rows()}


def test_a_new_checkpoint_has_no_header_and_no_rows(databases: Databases) -> None:
    checkpoint = databases.checkpoint()
    assert checkpoint.header(LOG_A) is None
    assert _rows(checkpoint) == {}


def test_rows_and_header_round_trip(databases: Databases) -> None:
    checkpoint = databases.checkpoint()
    before = time.time()
    written = checkpoint.write(
        [(b"a", b"1"), (b"b", b"2")], position=7, payload={"resume_offset": 3}, identity=LOG_A
    )
    checkpoint.close()
    again = databases.checkpoint()
    header = again.header(LOG_A)
    assert header == written
    assert header is not None
    assert (header.topic, header.partition, header.position) == (TOPIC, 0, 7)
    assert header.identity == LOG_A
    assert header.payload == {"resume_offset": 3}
    assert before <= header.saved_at <= time.time()
    assert _rows(again) == {b"a": b"1", b"b": b"2"}


def test_a_later_write_applies_its_changes_and_replaces_the_header(databases: Databases) -> None:
    checkpoint = databases.checkpoint()
    checkpoint.write([(b"a", b"1"), (b"b", b"2")], position=2, payload={"n": 1}, identity=LOG_A)
    checkpoint.write([(b"a", None), (b"c", b"3")], position=5, payload={"n": 2}, identity=LOG_B)
    header = checkpoint.header(LOG_B)
    assert header is not None
    assert (header.position, header.payload, header.identity) == (5, {"n": 2}, LOG_B)
    assert _rows(checkpoint) == {b"b": b"2", b"c": b"3"}
    checkpoint.discard()
    assert checkpoint.header(LOG_B) is None
    assert _rows(checkpoint) == {}


def _failing(rows: int) -> Iterator[tuple[bytes, bytes | None]]:
    """``rows`` rows, then a failure (an encoder giving up, a full disk)."""
    for n in range(rows):
        yield f"k{n}".encode(), b"new value"
    raise CheckpointError("disk full")


def test_the_header_is_never_ahead_of_the_rows(databases: Databases) -> None:
    checkpoint = databases.checkpoint()
    checkpoint.write([(b"k0", b"old")], position=1, payload={"n": 1}, identity=LOG_A)
    with pytest.raises(CheckpointError, match="disk full"):
        checkpoint.write(_failing(8), position=9, payload={"n": 2}, identity=LOG_A)
    header = checkpoint.header(LOG_A)
    assert header is not None
    assert (header.position, header.payload) == (1, {"n": 1}), "the rows' position, not ahead"
    # Rows written before the failure may be newer (batches): the role's fold allows it.
    assert set(_rows(checkpoint)) <= {f"k{n}".encode() for n in range(8)}
    checkpoint.write([(b"k9", b"v")], position=10, payload={}, identity=LOG_A)
    header = checkpoint.header(LOG_A)
    assert header is not None
    assert header.position == 10, "writable again"


_OLDER: dict[str, dict[str, Any]] = {
    "the triggerer's format 2": {
        "format": 2,
        "topic": TOPIC,
        "partition": 0,
        "defer_offset": 4,
        "resume_offset": 9,
        "saved_at": 0.0,
        "identity": None,
    },
    "the scheduler's format 3": {
        "format": 3,
        "topic": TOPIC,
        "positions": {"0": 4},
        "state": {},
        "saved_at": 0.0,
        "identity": None,
    },
    "no format at all": {"topic": TOPIC},
}


@pytest.mark.parametrize("older", list(_OLDER))
def test_a_header_of_another_format_is_unusable_and_says_so(
    databases: Databases, older: str
) -> None:
    databases.open().write([(b"a", b"1")], _OLDER[older])
    checkpoint = databases.checkpoint()
    with pytest.raises(CheckpointUnusable) as refused:
        checkpoint.header(LOG_A)
    found = _OLDER[older].get("format")
    assert (
        refused.value.reason == f"it is of format {found}, this version reads {CHECKPOINT_FORMAT}"
    )
    assert refused.value.mismatch is None, "not a checkpoint of another log"
    assert "cannot be restored" in str(refused.value)


def test_a_checkpoint_of_another_log_is_unusable_and_says_how(databases: Databases) -> None:
    checkpoint = databases.checkpoint()
    checkpoint.write([(b"a", b"1")], position=1, payload={}, identity=LOG_A)
    with pytest.raises(CheckpointUnusable) as refused:
        checkpoint.header(LOG_B)
    assert refused.value.reason == (
        "it was read from another log (topic id of p.defer: expected b, found a)"
    )
    assert refused.value.mismatch is not None
    assert (refused.value.mismatch.expected, refused.value.mismatch.found) == ("b", "a")
    assert checkpoint.header(LOG_A) is not None, "of the log read now"
    assert checkpoint.header() is not None, "no log given: not checked"


def test_a_checkpoint_that_records_no_log_is_unusable_where_the_log_is_known(
    databases: Databases,
) -> None:
    checkpoint = databases.checkpoint()
    checkpoint.write([(b"a", b"1")], position=1, payload={}, identity=None)
    with pytest.raises(CheckpointUnusable, match=r"read from another log .*none recorded"):
        checkpoint.header(LOG_A)
    header = checkpoint.header()
    assert header is not None
    assert header.identity is None


@pytest.mark.parametrize(("topic", "partition"), [(TOPIC, 1), ("p.other", 0)])
def test_a_checkpoint_of_another_partition_is_unusable(
    databases: Databases, topic: str, partition: int
) -> None:
    databases.checkpoint().write([], position=1, payload={}, identity=LOG_A)
    reader = MemberCheckpoint(databases.open(), topic=topic, partition=partition)
    with pytest.raises(
        CheckpointUnusable, match=f"it is of p.defer partition 0, not of {topic} partition"
    ):
        reader.header(LOG_A)


_VALID = CheckpointHeader(
    topic=TOPIC, partition=0, position=1, saved_at=0.0, identity=LOG_A, payload={}
).to_json()
_CORRUPT: dict[str, dict[str, Any]] = {
    "a field missing": {k: v for k, v in _VALID.items() if k != "position"},
    "a position that is no number": {**_VALID, "position": "seven"},
    "an unreadable identity": {**_VALID, "identity": {"cluster_id": "c"}},
    "a payload that is no object": {**_VALID, "payload": [1, 2]},
}


@pytest.mark.parametrize("corrupt", list(_CORRUPT))
def test_a_corrupt_header_is_a_clear_error(databases: Databases, corrupt: str) -> None:
    databases.open().write([], _CORRUPT[corrupt])
    with pytest.raises(CheckpointError, match=r"checkpoint .* is corrupt") as failed:
        databases.checkpoint().header(LOG_A)
    assert not isinstance(failed.value, CheckpointUnusable)


class _CorruptBlock:
    """What rocksdict does when a block of the database cannot be read: a bare Exception."""

    def get(self, key: bytes) -> bytes:
        raise Exception("Corruption: block checksum mismatch")

    def flush(self) -> None: ...

    def close(self) -> None: ...


def test_a_header_the_database_cannot_read_is_a_clear_error(tmp_path: Path) -> None:
    db = RocksPartitionDatabase(tmp_path / "0")
    db.write([], _VALID)
    db.close()
    db = RocksPartitionDatabase(tmp_path / "0")
    db._db.close()
    db._db = _CorruptBlock()
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint .*block checksum"):
        MemberCheckpoint(db, topic=TOPIC, partition=0).header(LOG_A)


def test_a_header_is_outdated_outside_the_partition_or_past_its_age() -> None:
    header = CheckpointHeader(
        topic=TOPIC, partition=0, position=5, saved_at=1000.0, identity=None, payload={}
    )
    assert header.outdated(0, 5, now=1000.0, max_age=60.0) is None
    assert header.outdated(5, 9, now=1060.0, max_age=60.0) is None
    assert header.outdated(6, 9, now=1000.0, max_age=60.0) == (
        "its position 5 is outside 6..9 (topic truncated?)"
    )
    assert header.outdated(0, 4, now=1000.0, max_age=60.0) == (
        "its position 5 is outside 0..4 (topic truncated?)"
    )
    assert header.outdated(0, 9, now=1000.0 + 7200, max_age=3600.0) == (
        "it is 2.0 h old (compaction may have dropped tombstones since)"
    )


def test_discards_are_reported_one_line_per_reason_and_counted_when_of_another_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counted: list[int] = []
    discards = DiscardedCheckpoints(TOPIC, on_other_log=counted.append)
    mismatch = compare_identity(LOG_B, LOG_A)
    other = CheckpointUnusable("x", "it was read from another log (y)", mismatch=mismatch)
    discards.add(2, other)
    discards.add(0, other)
    discards.add(1, "it is 13.0 h old")
    assert discards.partitions == [0, 1, 2]
    with caplog.at_level(logging.WARNING):
        discards.report(member="m1")
    lines = [r for r in caplog.records if "checkpoint discarded" in r.getMessage()]
    assert [r.getMessage() for r in lines] == [
        "checkpoint discarded: it was read from another log (y); "
        "rebuilding partitions [0, 2] of p.defer from the topics",
        "checkpoint discarded: it is 13.0 h old; rebuilding partitions [1] of p.defer from "
        "the topics",
    ]
    fields: dict[str, Any] = lines[0].__dict__
    assert (fields["expected"], fields["found"], fields["member"]) == ("b", "a", "m1")
    assert counted == [2], "the partitions read from another log"
    discards.report()
    assert counted == [2], "reported once"
    assert discards.partitions == []


# -- the same refusals as each role meets them --------------------------------------------


class Role(Protocol):
    """One role's checkpoints of partitions 0..3 of ``topic``, as the role writes and
    restores them."""

    topic: str

    async def save(self, partition: int, identity: LogIdentity | None) -> None:
        """Checkpoint the partition at position 3, read from ``identity``'s log."""

    def plant(self, partition: int, header: dict[str, Any]) -> None:
        """Store ``header`` as the partition's (as an older version would have)."""

    async def restore(
        self, partitions: list[int], identity: LogIdentity, *, begin: int = 0
    ) -> dict[int, int]:
        """Restore over ``identity``'s log, the partitions' offsets ``begin..10``: the
        position of each partition restored."""

    @property
    def mismatches(self) -> int:
        """Partition checkpoints discarded as read from another log."""

    def close(self) -> None: ...


class TriggererRole:
    topic = TOPIC

    def __init__(self, kind: str, root: Path) -> None:
        self._kind, self._root = kind, root
        self._dbs: dict[int, PartitionDatabase] = {}
        self._counted: list[int] = []
        self._store = CheckpointStore(self._db, on_mismatch=self._counted.append)
        self._checkpointer = Checkpointer(
            self._store,
            topic=TOPIC,
            max_age=3600.0,
            metrics=TriggererMetrics(CollectorRegistry()),
            log=lambda part=None, **fields: {"partition": part, **fields},
        )

    def _db(self, topic: str, partition: int) -> PartitionDatabase:
        db = self._dbs.get(partition)
        if db is None:
            db = self._dbs[partition] = (
                MemoryPartitionDatabase()
                if self._kind == "memory"
                else RocksPartitionDatabase(self._root / topic / str(partition))
            )
        return db

    async def save(self, partition: int, identity: LogIdentity | None) -> None:
        if identity is not None:
            await self._checkpointer.match_log([partition], identity)
        table = ActiveTriggerTable(defer_offset=2)
        table.apply(b"t", b"request", offset=2)
        self._store.write(TOPIC, partition, table.take_changes())

    def plant(self, partition: int, header: dict[str, Any]) -> None:
        self._db(TOPIC, partition).write([(b"t", b"0")], header)

    async def restore(
        self, partitions: list[int], identity: LogIdentity, *, begin: int = 0
    ) -> dict[int, int]:
        await self._checkpointer.match_log(partitions, identity)
        found = {}
        for p in partitions:
            part = OwnedPartition(
                number=p, defer_tp=TopicPartition(TOPIC, p), resume_tp=TopicPartition("r", p)
            )
            restored = await self._checkpointer.restore(
                part, Span(begin=begin, end=10), Span(begin=0, end=10)
            )
            if restored is not None:
                found[p] = restored.defer_offset
        return found

    @property
    def mismatches(self) -> int:
        return sum(self._counted)

    def close(self) -> None:
        self._store.close()


class _Offsets:
    """What the scheduler's restore asks a consumer: each partition's offsets now."""

    def __init__(self, begin: int, end: int) -> None:
        self._begin, self._end = begin, end

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, self._begin)

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, self._end)


class SchedulerRole:
    topic = "p.tasks"

    def __init__(self, root: Path) -> None:
        self._checkpoints = Checkpoints(root, interval=0.0, max_age=3600.0)
        self._open = False

    def _opened(self, identity: LogIdentity | None) -> Checkpoints:
        if not self._open:
            self._checkpoints.open(self.topic, range(4), total=4)
            self._open = True
        self._checkpoints._identity = identity  # the log it read (from the broker, at start)
        return self._checkpoints

    async def save(self, partition: int, identity: LogIdentity | None) -> None:
        checkpoints = self._opened(identity)
        table = TaskTable()
        table.track_changes()
        assert await checkpoints.write(table, table.export_changes(), {partition: 3})

    def plant(self, partition: int, header: dict[str, Any]) -> None:
        self.close()
        db = RocksPartitionDatabase(self._checkpoints.path(self.topic, partition))
        db.write([], header)
        db.close()

    async def restore(
        self, partitions: list[int], identity: LogIdentity, *, begin: int = 0
    ) -> dict[int, int]:
        checkpoints = self._opened(identity)
        tps = [TopicPartition(self.topic, p) for p in partitions]
        consumer = cast(AIOKafkaConsumer, _Offsets(begin, 10))
        found = await checkpoints.restore(TaskFold(), consumer, tps, prefix="p.", group="p.g")
        return {tp.partition: offset for tp, offset in found.items()}

    @property
    def mismatches(self) -> int:
        return self._checkpoints.mismatches

    def close(self) -> None:
        self._checkpoints.close()
        self._open = False


@pytest.fixture(params=["triggerer-memory", "triggerer-rocks", "scheduler-rocks"])
def role(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Role]:
    name, kind = request.param.split("-")
    made: Role = TriggererRole(kind, tmp_path) if name == "triggerer" else SchedulerRole(tmp_path)
    yield made
    made.close()


def _discarded(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if "checkpoint discarded" in r.getMessage()]
    caplog.clear()
    return lines


async def test_a_checkpoint_of_the_log_read_now_is_restored(role: Role) -> None:
    log = _log_of(role.topic, "a")
    await role.save(0, log)
    await role.save(1, log)
    assert await role.restore([0, 1, 2], log) == {0: 3, 1: 3}
    assert role.mismatches == 0


async def test_checkpoints_of_another_log_are_discarded_in_one_line_and_counted(
    role: Role, caplog: pytest.LogCaptureFixture
) -> None:
    old, new = _log_of(role.topic, "a"), _log_of(role.topic, "b")
    await role.save(0, old)
    await role.save(1, old)
    with caplog.at_level(logging.WARNING):
        assert await role.restore([0, 1, 2], new) == {}
        [line] = _discarded(caplog)
        assert f"read from another log (topic id of {role.topic}: expected b, found a)" in line
        assert f"rebuilding partitions [0, 1] of {role.topic}" in line
        assert role.mismatches == 2, "one per partition checkpoint"
        assert await role.restore([0, 1], new) == {}
        assert _discarded(caplog) == [], "discarded: gone"
    await role.save(0, new)
    assert await role.restore([0], new) == {0: 3}, "written since: of the new log"
    assert role.mismatches == 2


async def test_a_checkpoint_that_records_no_log_is_discarded_and_counted(
    role: Role, caplog: pytest.LogCaptureFixture
) -> None:
    await role.save(0, None)  # no log known yet when it was written
    with caplog.at_level(logging.WARNING):
        assert await role.restore([0], _log_of(role.topic, "a")) == {}
    [line] = _discarded(caplog)
    assert "read from another log (identity: expected" in line
    assert "none recorded" in line
    assert role.mismatches == 1


async def test_older_formats_and_other_partitions_are_discarded_with_their_reason(
    role: Role, caplog: pytest.LogCaptureFixture
) -> None:
    log = _log_of(role.topic, "a")
    role.plant(0, {"format": 3, "topic": role.topic, "positions": {"0": 3}, "identity": None})
    role.plant(1, {"format": 2, "topic": role.topic, "partition": 1, "defer_offset": 3})
    elsewhere = CheckpointHeader(
        topic=role.topic, partition=0, position=3, saved_at=time.time(), identity=log, payload={}
    )
    role.plant(2, elsewhere.to_json())  # a copy of partition 0's database
    with caplog.at_level(logging.WARNING):
        assert await role.restore([0, 1, 2], log) == {}
        lines = _discarded(caplog)
        assert sorted(lines) == sorted(
            [
                f"checkpoint discarded: it is of format 3, this version reads 4; "
                f"rebuilding partitions [0] of {role.topic} from the topics",
                f"checkpoint discarded: it is of format 2, this version reads 4; "
                f"rebuilding partitions [1] of {role.topic} from the topics",
                f"checkpoint discarded: it is of {role.topic} partition 0, not of "
                f"{role.topic} partition 2; rebuilding partitions [2] of {role.topic} "
                "from the topics",
            ]
        )
        assert role.mismatches == 0, "not of another log"
        assert await role.restore([0, 1, 2], log) == {}
        assert _discarded(caplog) == [], "discarded: gone"


async def test_a_checkpoint_past_the_partitions_offsets_is_discarded_and_not_counted(
    role: Role, caplog: pytest.LogCaptureFixture
) -> None:
    log = _log_of(role.topic, "a")
    await role.save(0, log)
    with caplog.at_level(logging.WARNING):
        assert await role.restore([0], log, begin=5) == {}
        [line] = _discarded(caplog)
    assert "its position 3 is outside 5..10 (topic truncated?)" in line
    assert role.mismatches == 0
    assert await role.restore([0], log) == {}, "discarded"


async def test_an_unreadable_checkpoint_is_discarded_naming_it_and_written_again(
    role: Role, caplog: pytest.LogCaptureFixture
) -> None:
    log = _log_of(role.topic, "a")
    header = CheckpointHeader(
        topic=role.topic, partition=0, position=3, saved_at=time.time(), identity=log, payload={}
    ).to_json()
    del header["position"]
    role.plant(0, header)
    with caplog.at_level(logging.WARNING):
        assert await role.restore([0], log) == {}
        [line] = _discarded(caplog)
    assert "is corrupt: KeyError('position')" in line
    assert f"rebuilding partitions [0] of {role.topic} from the topics" in line
    assert role.mismatches == 0
    await role.save(0, log)
    assert await role.restore([0], log) == {0: 3}, "checkpointed afresh"


class _UnreadableRows:
    """Rows whose iteration fails as a bad block's does in rocksdict: a bare Exception."""

    def __iter__(self) -> _UnreadableRows:
        return self

    def __next__(self) -> tuple[bytes, bytes]:
        raise Exception("Corruption: block checksum mismatch")


async def test_rows_the_database_cannot_read_discard_the_checkpoint_and_it_is_written_again(
    role: Role, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _log_of(role.topic, "a")
    await role.save(0, log)

    def corrupt(self: PartitionDatabase) -> Iterator[tuple[bytes, bytes]]:
        return _UnreadableRows()

    with monkeypatch.context() as patched:
        patched.setattr(RocksPartitionDatabase, "rows", corrupt)
        patched.setattr(MemoryPartitionDatabase, "rows", corrupt)
        with caplog.at_level(logging.WARNING):
            assert await role.restore([0], log) == {}
            [line] = _discarded(caplog)
    assert "block checksum mismatch" in line
    assert f"rebuilding partitions [0] of {role.topic} from the topics" in line
    await role.save(0, log)
    assert await role.restore([0], log) == {0: 3}, "checkpointed afresh"
