"""Benchmark figures kept as data: one JSON file per bench run under ``bench/figures/``.

A bench script opens a :class:`Sitting` when it starts (its date, load average and command
line are taken then) and writes the figures it printed when it ends (with the commit and the
machine, read from git and /proc)::

    sitting = Sitting.begin("end_to_end", broker=args.backend)
    ...
    sitting.write([Figure("e2e.due_at_once_10k", "10,000 due at once …", 2.04, "s")])

Each :class:`Figure` is one claim: a stable id (``e2e.due_at_once_10k``), what was measured,
the value and its unit, and a peer (Airflow, librdkafka …) when one ran in the same sitting.
``bench/render_figures.py`` renders the tables of docs/benchmarks.md and README.md from these
files, the newest record of each claim winning.

``DEFERLINE_BENCH_RECORD=0`` runs a bench without writing its record. A run that measures
another build (``--deferline <its executable>``, or another checkout's interpreter) writes
none either: a record's commit is the build it measured.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "bench" / "figures"
RECORD_ENV = "DEFERLINE_BENCH_RECORD"
BROKERS = ("kafka", "tansu", "none")
UNKNOWN = "unknown"
_CLAIM = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)+$")
_NAME = re.compile(r"^(.*?)(?:_(\d+))?\.json$")  # <file stem>[_<n>].json

Value = float | str


@dataclass(frozen=True, slots=True)
class Peer:
    """A peer's figure from the same sitting (Airflow's triggerer, say): a number in its
    claim's unit, or text that carries its own ("63.62 / 61.12 s")."""

    name: str
    value: Value


@dataclass(frozen=True, slots=True)
class Figure:
    """One claim of a run: ``claim`` is a stable slug, ``label`` says what was measured.

    ``value`` is a number, or text where a range or a pair is the figure ("4.0 / 10.1");
    ``note`` carries what qualifies it (runs, a median, what the peer is).
    """

    claim: str
    label: str
    value: Value
    unit: str
    peer: Peer | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if not _CLAIM.match(self.claim):
            raise ValueError(f"claim id {self.claim!r} is not a dotted lower-case slug")


@dataclass(frozen=True, slots=True)
class Machine:
    """What the run ran on; ``kind`` ("2-core AMD EPYC, 24 GB") groups the figures."""

    kind: str
    cpu: str
    cores: int | None
    memory_gb: int | None

    @classmethod
    def this(cls) -> Machine:
        """This machine, read from /proc."""
        cpu = _cpuinfo_model() or UNKNOWN
        cores = os.cpu_count()
        memory = _memory_gb()
        family = _cpu_family(cpu)
        kind = f"{cores}-core {family}, {memory} GB" if memory else f"{cores}-core {family}"
        return cls(kind=kind, cpu=cpu, cores=cores, memory_gb=memory)


@dataclass(frozen=True, slots=True)
class Record:
    """One bench run: where and when it ran, and the claims it printed.

    ``date`` is UTC ISO 8601 (a date alone where only the day is known); ``load_average`` the
    1, 5 and 15 minute load averages at the start (a record taken from a write-up: the load it
    gives); ``source`` the page that writes the run up, when there is one.
    """

    bench: str
    command: str
    commit: str
    machine: Machine
    date: str
    broker: str
    load_average: str
    claims: tuple[Figure, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if self.broker not in BROKERS:
            raise ValueError(f"broker {self.broker!r} is not one of {BROKERS}")

    @property
    def file_stem(self) -> str:
        """``<date>-<bench>-<broker>-<short commit>``, the name its file starts with."""
        return f"{self.date[:10]}-{self.bench}-{self.broker}-{self.commit[:7]}"

    def to_json(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "command": self.command,
            "commit": self.commit,
            "machine": {
                "kind": self.machine.kind,
                "cpu": self.machine.cpu,
                "cores": self.machine.cores,
                "memory_gb": self.machine.memory_gb,
            },
            "date": self.date,
            "broker": self.broker,
            "load_average": self.load_average,
            "source": self.source,
            "claims": [
                {
                    "claim": f.claim,
                    "label": f.label,
                    "value": f.value,
                    "unit": f.unit,
                    "peer": None
                    if f.peer is None
                    else {"name": f.peer.name, "value": f.peer.value},
                    "note": f.note,
                }
                for f in self.claims
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        machine = data["machine"]
        return cls(
            bench=data["bench"],
            command=data["command"],
            commit=data["commit"],
            machine=Machine(
                kind=machine["kind"],
                cpu=machine["cpu"],
                cores=machine["cores"],
                memory_gb=machine["memory_gb"],
            ),
            date=data["date"],
            broker=data["broker"],
            load_average=data["load_average"],
            source=data.get("source", ""),
            claims=tuple(
                Figure(
                    claim=c["claim"],
                    label=c["label"],
                    value=c["value"],
                    unit=c["unit"],
                    peer=None if c.get("peer") is None else Peer(**c["peer"]),
                    note=c.get("note", ""),
                )
                for c in data["claims"]
            ),
        )


def write_record(record: Record, directory: Path = FIGURES) -> Path:
    """Write ``record`` as a new JSON file in ``directory``; never overwrites one."""
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record.to_json(), indent=2, ensure_ascii=False) + "\n"
    for attempt in range(1, 1000):
        suffix = "" if attempt == 1 else f"_{attempt}"
        path = directory / f"{record.file_stem}{suffix}.json"
        try:
            with path.open("x", encoding="utf-8") as out:
                out.write(text)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free name for {record.file_stem} in {directory}")


def read_records(directory: Path = FIGURES) -> list[Record]:
    """Every record in ``directory``, oldest first: by date, then in the order written."""
    found = []
    for path in directory.glob("*.json"):
        named = _NAME.match(path.name)
        stem, attempt = (named.group(1), int(named.group(2) or 1)) if named else (path.name, 1)
        record = Record.from_json(json.loads(path.read_text(encoding="utf-8")))
        found.append(((record.date, stem, attempt), record))
    found.sort(key=lambda item: item[0])
    return [record for _, record in found]


@dataclass(slots=True)
class Sitting:
    """A bench run under way: what is known at its start, and the write at its end."""

    bench: str
    broker: str
    command: str
    date: str
    load_average: str
    other_build: str | None = None

    @classmethod
    def begin(cls, bench: str, *, broker: str = "none", deferline: str | None = None) -> Sitting:
        """Note the start of a run of ``bench`` on ``broker``.

        ``deferline``: the executable the run starts, when it takes one; a build other than
        this checkout's means the run is not recorded.
        """
        return cls(
            bench=bench,
            broker=broker,
            command=_command_line(),
            date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            load_average=_load_average(),
            other_build=_other_build(deferline),
        )

    def write(
        self, claims: Iterable[Figure], directory: Path | None = None, *, broker: str | None = None
    ) -> Path | None:
        """Write the run's record with ``claims``; return its path (None when not written).

        ``broker``: the claims' broker, where one run measures on several (one record each).
        """
        figures = tuple(claims)
        if not figures:
            return None
        if os.environ.get(RECORD_ENV, "1") in ("0", "false", "no"):
            return None
        if self.other_build is not None:
            print(f"(figures not recorded: they are of another build, {self.other_build})")
            return None
        record = Record(
            bench=self.bench,
            command=self.command,
            commit=_git_commit(),
            machine=Machine.this(),
            date=self.date,
            broker=broker or self.broker,
            load_average=self.load_average,
            claims=figures,
        )
        path = write_record(record, directory or FIGURES)
        print(f"(figures recorded in {_relative(path)})")
        return path


def size_slug(n: int) -> str:
    """``1k``, ``10k``, ``1m`` … for claim ids; other counts as they are."""
    for scale, letter in ((1_000_000, "m"), (1_000, "k")):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{letter}"
    return str(n)


def runs_figure(
    claim: str,
    label: str,
    values: Sequence[float],
    unit: str,
    *,
    peer: Peer | None = None,
    note: str = "",
) -> Figure:
    """One claim over repeated runs: their median, each run named in the note."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    median = round(median, 6)  # the mean of two rounded runs, without its float noise
    if len(values) > 1:
        runs = ", ".join(f"{v:.3g}" for v in values)
        note = f"median of {len(values)} runs: {runs}" + (f"; {note}" if note else "")
    return Figure(claim, label, median, unit, peer=peer, note=note)


# -- what a run is taken from ---------------------------------------------------------------


def _command_line() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["-m", spec.name] if spec is not None else [_relative(Path(sys.argv[0]))]
    return shlex.join([_relative(Path(sys.executable)), *head, *sys.argv[1:]])


def _relative(path: Path) -> str:
    absolute = path if path.is_absolute() else Path.cwd() / path
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _git_commit() -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return UNKNOWN
    return done.stdout.strip() or UNKNOWN


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return UNKNOWN


def _cpuinfo_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model"):
            return value.strip()
    return None


def _cpu_family(model: str) -> str:
    """The first two words of a CPU model, without trademarks: "AMD EPYC", "Intel Xeon"."""
    words = re.sub(r"\((R|TM|tm|r)\)", "", model).split()
    return " ".join(words[:2]) if words else UNKNOWN


def _memory_gb() -> int | None:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20)
    return None


def is_this_build(executable: str) -> bool:
    """Whether ``executable`` is this checkout's ``deferline`` (the one beside this Python)."""
    return Path(executable).resolve() == Path(sys.executable).with_name("deferline").resolve()


def _other_build(deferline: str | None) -> str | None:
    """The build measured when it is not this checkout's, else None."""
    if deferline is not None and not is_this_build(deferline):
        return deferline
    spec = importlib.util.find_spec("deferline.schemas")
    origin = None if spec is None or spec.origin is None else Path(spec.origin).resolve()
    if origin is not None and not origin.is_relative_to(ROOT):
        return str(origin.parent.parent)
    return None
