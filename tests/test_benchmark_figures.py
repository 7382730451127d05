"""Benchmark figures kept as data: the records round-trip, and the docs' tables are rendered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import render_figures
from bench._figures import (
    RECORD_ENV,
    ROOT,
    Figure,
    Machine,
    Peer,
    Record,
    Sitting,
    read_records,
    size_slug,
    write_record,
)

MACHINE = Machine(kind="2-core Test CPU, 8 GB", cpu="Test CPU 1", cores=2, memory_gb=8)


def record(date: str, value: float, *, broker: str = "kafka", kind: str = MACHINE.kind) -> Record:
    machine = Machine(kind=kind, cpu=MACHINE.cpu, cores=2, memory_gb=8)
    return Record(
        bench="end_to_end",
        command=".venv/bin/python -m bench.bench_end_to_end --n 10000",
        commit="0123456789abcdef",
        machine=machine,
        date=date,
        broker=broker,
        load_average="0.10 0.20 0.30",
        claims=(
            Figure(
                "e2e.due_at_once_10k",
                "10,000 due at once",
                value,
                "s",
                peer=Peer("Airflow, same sitting", 61.1),
            ),
        ),
    )


def test_the_docs_tables_are_the_ones_the_records_render() -> None:
    stale = [
        str(path.relative_to(ROOT))
        for path, text in render_figures.rendered().items()
        if path.read_text(encoding="utf-8") != text
    ]
    assert not stale, f"out of date: {stale}; run .venv/bin/python -m bench.render_figures"


def test_the_check_exits_zero_on_the_checkout() -> None:
    assert render_figures.main(["--check"]) == 0


def test_a_record_round_trips_through_its_file(tmp_path: Path) -> None:
    written = record("2026-12-02T10:00:00Z", 2.04)
    path = write_record(written, tmp_path)
    assert path.name == "2026-12-02-end_to_end-kafka-0123456.json"
    assert json.loads(path.read_text())["claims"][0]["claim"] == "e2e.due_at_once_10k"
    assert read_records(tmp_path) == [written]


def test_records_of_one_day_keep_the_order_they_were_written(tmp_path: Path) -> None:
    first, second, third = (record("2026-12-02", value) for value in (1.0, 2.0, 3.0))
    names = [write_record(r, tmp_path).name for r in (first, second, third)]
    assert names[1:] == [names[0].replace(".json", "_2.json"), names[0].replace(".json", "_3.json")]
    assert read_records(tmp_path) == [first, second, third]


def test_the_newest_record_wins_per_claim_machine_kind_and_broker() -> None:
    records = [
        record("2026-11-01", 3.0),
        record("2026-11-02", 2.0),
        record("2026-11-03", 1.5, broker="tansu"),
        record("2026-11-04", 9.0, kind="2-core Other CPU, 4 GB"),
    ]
    latest = render_figures.current(records)
    assert {key: figure.value for key, (_, figure) in latest.items()} == {
        ("e2e.due_at_once_10k", MACHINE.kind, "kafka"): 2.0,
        ("e2e.due_at_once_10k", MACHINE.kind, "tansu"): 1.5,
        ("e2e.due_at_once_10k", "2-core Other CPU, 4 GB", "kafka"): 9.0,
    }
    table = render_figures.render_tables(records)
    assert "| 10,000 due at once | 2 s | Airflow, same sitting: 61.1 s | Apache Kafka |" in table


def test_a_sitting_records_this_machine_unless_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sitting = Sitting.begin("schemas")
    figure = Figure("schemas.make_event_id", "`make_event_id`", 3.6, "µs")
    path = sitting.write([figure], tmp_path)
    assert path is not None
    (written,) = read_records(tmp_path)
    assert written.claims == (figure,)
    assert written.broker == "none"
    assert written.machine.cores is not None
    assert written.machine.kind.startswith(f"{written.machine.cores}-core ")
    monkeypatch.setenv(RECORD_ENV, "0")
    assert Sitting.begin("schemas").write([figure], tmp_path) is None
    assert len(list(tmp_path.iterdir())) == 1


def test_claim_ids_are_dotted_slugs() -> None:
    with pytest.raises(ValueError, match="slug"):
        Figure("E2E 10k", "x", 1.0, "s")
    assert [size_slug(n) for n in (1_000, 10_000, 1_000_000, 995_274)] == [
        "1k",
        "10k",
        "1m",
        "995274",
    ]
