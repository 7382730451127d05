"""Render the figure tables of docs/benchmarks.md and README.md from bench/figures/*.json.

docs/benchmarks.md gets one table per component between ``<!-- figures:begin -->`` and
``<!-- figures:end -->``: one row per claim, machine kind and broker, the newest record
winning, with its peer from the same sitting, date, commit and command. README.md gets the
headline claims (:data:`HEADLINES`) between ``<!-- figures:headline:begin -->`` and
``<!-- figures:headline:end -->``, each the newest figure on any machine.

Run from the checkout's root::

    .venv/bin/python -m bench.render_figures           # rewrite both tables in place
    .venv/bin/python -m bench.render_figures --check   # exit 1 when either is out of date
"""

from __future__ import annotations

import argparse
import os.path
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from bench._figures import FIGURES, ROOT, Figure, Record, Value, read_records

BENCHMARKS = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
TABLES = ("<!-- figures:begin -->", "<!-- figures:end -->")
HEADLINE = ("<!-- figures:headline:begin -->", "<!-- figures:headline:end -->")

# A claim's table is the first whose prefix its id starts with.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Schemas and codec", ("schemas.",)),
    ("Engine supervisor", ("engine.",)),
    ("Triggerer member", ("triggerer.", "ingest.")),
    ("Checkpoints and restart", ("checkpoint.", "restart.")),
    ("Rebalance and failover", ("rebalance.", "failover.", "churn.")),
    ("Scheduler process", ("scheduler.",)),
    ("End to end", ("e2e.",)),
    ("Worker process", ("worker.",)),
    ("Replay tools", ("replay.",)),
    ("Airflow trigger classes", ("airflow_triggers.",)),
    ("Airflow bridge", ("bridge.", "writeback.")),
    ("Airflow services", ("services.",)),
    (
        "Standing watches, asset watchers and trigger logs",
        ("watches.", "asset_watchers.", "trigger_logs.", "trigger_log_load."),
    ),
    ("Console", ("console.",)),
    ("Tracing", ("tracing.",)),
    ("Kafka clients", ("clients.",)),
    ("Other", ("",)),
)

# README's figures: (claim, broker, row label), each the newest record on any machine.
HEADLINES: tuple[tuple[str, str, str], ...] = (
    ("e2e.due_at_once_10k", "kafka", "10,000 tasks due at once, end to end: due → none deferred"),
    (
        "bridge.airflow3.due_at_once_10k",
        "kafka",
        "10,000 Airflow 3 task instances due at once, `deferline airflow bridge` in place of "
        "`airflow triggerer`",
    ),
    ("bridge.airflow2.due_at_once_10k", "kafka", "the same on Airflow 2.10"),
    ("engine.timer_memory_1m", "none", "waiting timer triggers, memory each (1,000,000)"),
    ("triggerer.burst_1m", "kafka", "1,000,000 timers due at once in one triggerer: events out"),
    ("failover.triggerer_sigkill", "kafka", "SIGKILLed triggerer → its triggers running elsewhere"),
    (
        "failover.cluster_lost_sigkill",
        "kafka",
        "the whole Kafka cluster lost for 30 s: broker back → last task resumed",
    ),
    (
        "rebalance.join_probe_p99_100k",
        "kafka",
        "a third triggerer joins two holding 100,000 timers: probe p99, kept / moved partitions",
    ),
    ("replay.stuck_1m", "kafka", "`replay stuck` over a 1,000,000-record topic set"),
)

BROKER_NAMES = {"kafka": "Apache Kafka", "tansu": "Tansu", "none": "—"}
_BROKER_ORDER = {"kafka": 0, "tansu": 1, "none": 2}

Key = tuple[str, str, str]  # claim, machine kind, broker
Entry = tuple[Record, Figure]


def current(records: Iterable[Record]) -> dict[Key, Entry]:
    """The newest figure of each claim per machine kind and broker (``records`` oldest first)."""
    latest: dict[Key, Entry] = {}
    for record in records:
        for figure in record.claims:
            latest[(figure.claim, record.machine.kind, record.broker)] = (record, figure)
    return latest


def render_tables(records: Sequence[Record], *, docs: Path = BENCHMARKS.parent) -> str:
    """docs/benchmarks.md's tables: a heading and a table per group that has a claim."""
    grouped: dict[str, list[tuple[Key, Entry]]] = {title: [] for title, _ in GROUPS}
    for key, entry in current(records).items():
        grouped[_group(key[0])].append((key, entry))
    parts = []
    for title, rows in grouped.items():
        if not rows:
            continue
        rows.sort(key=lambda row: (_natural(row[0][0]), row[0][1], _BROKER_ORDER[row[0][2]]))
        lines = [
            f"### {title}",
            "",
            "| figure | value | peer, same sitting | broker | machine | load | date | commit "
            "| command |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for _, (record, figure) in rows:
            cells = (
                figure.label,
                _value_cell(figure),
                _peer_cell(figure),
                BROKER_NAMES[record.broker],
                record.machine.kind,
                record.load_average,
                _date_cell(record, docs),
                record.commit[:7],
                f"`{record.command}`",
            )
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def render_headline(records: Sequence[Record], *, base: Path = ROOT) -> str:
    """README.md's table: each headline claim's newest figure, with its peer."""
    newest: dict[tuple[str, str], Entry] = {}
    for record in records:
        for figure in record.claims:
            newest[(figure.claim, record.broker)] = (record, figure)
    lines = [
        "| | deferline | beside it, same sitting | measured |",
        "|---|---|---|---|",
    ]
    for claim, broker, label in HEADLINES:
        if (claim, broker) not in newest:
            continue
        record, figure = newest[(claim, broker)]
        measured = f"{_date_cell(record, base)}, {record.machine.kind}"
        if record.broker != "none":
            measured += f", {BROKER_NAMES[record.broker]}"
        cells = (label, f"**{_value(figure)}**", _peer_cell(figure), measured)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def replace_between(text: str, markers: tuple[str, str], body: str, *, name: str) -> str:
    """``text`` with what lies between the two marker lines replaced by ``body``."""
    begin, end = markers
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"{name}: no {begin} … {end} pair")
    return text[: start + len(begin)] + "\n" + body + "\n" + text[stop:]


def rendered(directory: Path = FIGURES) -> dict[Path, str]:
    """Both files as they should read, from the records in ``directory``."""
    records = read_records(directory)
    return {
        BENCHMARKS: replace_between(
            BENCHMARKS.read_text(encoding="utf-8"),
            TABLES,
            render_tables(records),
            name="docs/benchmarks.md",
        ),
        README: replace_between(
            README.read_text(encoding="utf-8"),
            HEADLINE,
            render_headline(records),
            name="README.md",
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when a table is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in rendered().items():
        if path.read_text(encoding="utf-8") == text:
            continue
        if args.check:
            stale.append(path.relative_to(ROOT))
        else:
            path.write_text(text, encoding="utf-8")
            print(f"rendered {path.relative_to(ROOT)}")
    if stale:
        names = ", ".join(str(path) for path in stale)
        print(
            f"out of date: {names}; run .venv/bin/python -m bench.render_figures", file=sys.stderr
        )
        return 1
    return 0


def _group(claim: str) -> str:
    return next(title for title, prefixes in GROUPS if claim.startswith(prefixes))


def _natural(claim: str) -> tuple[str | float, ...]:
    """Sort key that puts ``…_1k`` before ``…_10k`` before ``…_1m``."""
    scale = {"": 1, "k": 1e3, "m": 1e6}
    parts = re.split(r"(\d+[km]?)(?![a-z])", claim)
    return tuple(
        float(part.rstrip("km")) * scale[part[-1] if part[-1] in "km" else ""] if i % 2 else part
        for i, part in enumerate(parts)
    )


def _number(value: Value) -> str:
    if isinstance(value, str):
        return value
    if value != value:
        return "n/a"
    if abs(value) >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _value(figure: Figure) -> str:
    if not figure.unit:
        return _number(figure.value)
    space = "" if figure.unit.startswith("/") else " "
    return f"{_number(figure.value)}{space}{figure.unit}"


def _value_cell(figure: Figure) -> str:
    shown = _value(figure)
    return f"{shown} ({figure.note})" if figure.note else shown


def _peer_cell(figure: Figure) -> str:
    """A peer's text value is shown as written (with its unit); a number takes the claim's unit."""
    if figure.peer is None:
        return "—"
    value = figure.peer.value
    shown = (
        value if isinstance(value, str) else _value(Figure(figure.claim, "", value, figure.unit))
    )
    return f"{figure.peer.name}: {shown}"


def _date_cell(record: Record, base: Path) -> str:
    day = record.date[:10]
    if not record.source:
        return day
    page, _, anchor = record.source.partition("#")
    link = Path(_relpath(ROOT / page, base))
    return f"[{day}]({link}{'#' + anchor if anchor else ''})"


def _relpath(target: Path, base: Path) -> str:
    return os.path.relpath(target, base)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    sys.exit(main())
