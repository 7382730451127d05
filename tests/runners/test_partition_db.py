"""One contract for every partition database a member keeps its checkpoints in: rocksdict on
disk and the dict in memory behave the same (the triggerer's and the scheduler's stores sit
on them)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from deferline.runners.member import (
    ROW_PREFIX,
    MemoryPartitionDatabase,
    PartitionDatabase,
    RocksPartitionDatabase,
)
from deferline.runners.testing import CheckpointError, CheckpointInUse
from hypothesis import given, settings
from hypothesis import strategies as st

# Opens the database of one partition again (a reopen sees what was written before).
Opener = Callable[[], PartitionDatabase]


@pytest.fixture(params=["memory", "rocks"])
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    opened: list[PartitionDatabase] = []
    memory = MemoryPartitionDatabase("p/0 in memory")

    def open_one() -> PartitionDatabase:
        db: PartitionDatabase
        db = memory if request.param == "memory" else RocksPartitionDatabase(tmp_path / "p" / "0")
        opened.append(db)
        return db

    yield open_one
    for db in opened:
        db.close()


def test_a_new_database_has_no_header_and_no_rows(reopen: Opener) -> None:
    db = reopen()
    assert db.header() is None
    assert list(db.rows()) == []


def test_rows_and_header_round_trip_in_key_order(reopen: Opener) -> None:
    db = reopen()
    header = {"format": 1, "topic": "p.defer", "positions": {"0": 7}, "identity": None}
    db.write([(b"b", b"2"), (b"a", b"1"), (b"c", b"")], header)
    assert db.header() == header
    expected = [(b"a", b"1"), (b"b", b"2"), (b"c", b"")]
    assert list(db.rows()) == [(ROW_PREFIX + k, v) for k, v in expected]


def test_none_deletes_a_row_and_a_later_write_replaces_the_header(reopen: Opener) -> None:
    db = reopen()
    db.write([(b"a", b"1"), (b"b", b"2")], {"position": 1})
    db.write([(b"a", None), (b"b", b"3"), (b"never-written", None)], {"position": 2})
    assert db.header() == {"position": 2}
    assert list(db.rows()) == [(ROW_PREFIX + b"b", b"3")]


def test_what_was_written_outlives_close(reopen: Opener) -> None:
    db = reopen()
    db.write([(b"a", b"1")], {"position": 1})
    db.close()
    again = reopen()
    assert again.header() == {"position": 1}
    assert list(again.rows()) == [(ROW_PREFIX + b"a", b"1")]


def test_discard_forgets_rows_and_header(reopen: Opener) -> None:
    db = reopen()
    db.write([(b"a", b"1"), (b"b", b"2")], {"position": 1})
    db.discard()
    assert db.header() is None
    assert list(db.rows()) == []
    db.write([(b"c", b"3")], {"position": 2})  # and is usable again
    assert list(db.rows()) == [(ROW_PREFIX + b"c", b"3")]


_KEYS = st.binary(min_size=0, max_size=6)
_WRITES = st.lists(
    st.one_of(
        st.lists(st.tuples(_KEYS, st.one_of(st.none(), st.binary(max_size=8))), max_size=8),
        st.just("discard"),
    ),
    max_size=12,
)


@pytest.mark.parametrize("kind", ["memory", "rocks"])
@settings(max_examples=40, deadline=None)
@given(steps=_WRITES)
def test_any_writes_and_discards_leave_what_a_dict_would(kind: str, steps: list[object]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db: PartitionDatabase = (
            MemoryPartitionDatabase() if kind == "memory" else RocksPartitionDatabase(Path(tmp))
        )
        try:
            model: dict[bytes, bytes] = {}
            header: dict[str, int] | None = None
            for number, step in enumerate(steps):
                if step == "discard":
                    db.discard()
                    model, header = {}, None
                    continue
                assert isinstance(step, list)
                header = {"step": number}
                db.write(step, header)
                for key, value in step:
                    if value is None:
                        model.pop(key, None)
                    else:
                        model[key] = value
            assert db.header() == header
            assert list(db.rows()) == [(ROW_PREFIX + k, v) for k, v in sorted(model.items())]
        finally:
            db.close()


def test_an_unreadable_header_is_a_checkpoint_error(tmp_path: Path) -> None:
    from rocksdict import Options, Rdict

    raw = Rdict(str(tmp_path), Options(raw_mode=True))
    raw.put(b"m", b"{not json")
    raw.close()
    db = RocksPartitionDatabase(tmp_path)
    try:
        with pytest.raises(CheckpointError, match="is corrupt"):
            db.header()
    finally:
        db.close()


def test_a_database_another_holder_has_open_is_in_use(tmp_path: Path) -> None:
    first = RocksPartitionDatabase(tmp_path)
    try:
        with pytest.raises(CheckpointInUse, match="in use by another process"):
            RocksPartitionDatabase(tmp_path)
    finally:
        first.close()
