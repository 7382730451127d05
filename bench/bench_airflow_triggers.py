"""Airflow's own DateTimeTrigger under deferline's supervisor, beside deferline's DateTimeTrigger.

N triggers loaded through ``load_trigger`` (a triggerer lane's path: allowlist, import and
adapter, the resolved class cached as a lane caches it)
wait, then all fall due at one moment, a margin after they are added (3 s plus N/5,000 s for
deferline's, N/1,000 s for Airflow's, so that adding them all fits before it). Measured: RSS
per waiting trigger, due → all fired, fire lag p50/p99 and CPU per trigger from adding to
the last fire. Loggers at WARNING. Each case runs in a fresh subprocess; the first load
(Airflow's import) is reported apart. Runs on the Airflow line installed in the interpreter
(``.venv``: Airflow 3; ``.venv-airflow2``: 2.10).

``--before DIR`` also measures Airflow's trigger with the deferline packages of the checkout
in DIR (say, main in a second worktree) in place of this one's, first, in the same run: a
before/after of the same script on the same machine.

``--coroutines N`` adds N of Airflow's date-time trigger run as coroutines (a subclass with its
own ``run()``, as every Airflow trigger but the date-time ones runs): this checkout's, the same
with Airflow services configured (``use_airflow_services``: each such trigger gets a greenback
portal for sync calls, though it asks for nothing), and ``--before``'s.

Run: .venv/bin/python -m bench.bench_airflow_triggers [--n 100000] [--before ../wt-before]
     [--coroutines 10000]
     add --case airflow --n 1000 to run one case in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.metadata
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench._figures import Figure, Sitting


def _airflow_version() -> str:
    try:
        return importlib.metadata.version("apache-airflow")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


AIRFLOW_VERSION = _airflow_version()
# Airflow's built-in triggers: in the standard provider from Airflow 3, in core before.
AIRFLOW_TRIGGERS = (
    "airflow.providers.standard.triggers"
    if AIRFLOW_VERSION.split(".")[0] == "3"
    else "airflow.triggers"
)
_RUNNING = "bench._airflow_running_trigger"
CLASSPATHS = {
    "deferline": ("deferline.engine.triggers.DateTimeTrigger", "deferline.engine.triggers"),
    "airflow": (f"{AIRFLOW_TRIGGERS}.temporal.DateTimeTrigger", AIRFLOW_TRIGGERS),
    # The same, as a coroutine (its own run()); then with Airflow services configured, which
    # gives each such trigger a greenback portal for sync calls, though it asks for nothing.
    "airflow-run": (f"{_RUNNING}.RunningDateTimeTrigger", _RUNNING),
    "airflow-run-services": (f"{_RUNNING}.RunningDateTimeTrigger", _RUNNING),
}
# The top-level directories of a checkout that are the deferline.* packages (pyproject.toml).
PACKAGES = ("client", "engine", "replay", "runners", "schemas", "topics")


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


async def measure(case: str, n: int) -> dict[str, Any]:
    import gc

    from deferline.engine import TriggerOutcome, TriggerSupervisor, load_trigger

    logging.basicConfig(level=logging.WARNING)
    classpath, prefix = CLASSPATHS[case]
    if case.endswith("-services"):  # never asked: these triggers ask for nothing
        from deferline.engine import use_airflow_services

        use_airflow_services(["http://127.0.0.1:9"])
    rss0 = _rss()
    t0 = time.perf_counter()
    load_trigger(classpath, {"moment": dt.datetime.now(dt.UTC)}, allowed_prefixes=[prefix])
    import_s = time.perf_counter() - t0
    gc.collect()
    rss1 = _rss()

    outcomes: list[TriggerOutcome] = []
    done = asyncio.Event()

    def on_event(outcome: TriggerOutcome) -> None:
        outcomes.append(outcome)
        if len(outcomes) == n:
            done.set()

    due = dt.datetime.now(dt.UTC) + dt.timedelta(
        seconds=3.0 + n / (5_000 if case == "deferline" else 1_000 if case == "airflow" else 500)
    )
    classes: dict[str, Any] = {}  # a triggerer lane's cache of resolved classes
    cpu0 = time.process_time()
    async with TriggerSupervisor(capacity=n, on_event=on_event) as sup:
        for _ in range(n):
            trigger = load_trigger(
                classpath, {"moment": due}, allowed_prefixes=[prefix], classes=classes
            )
            sup.add(str(uuid.uuid4()), trigger)
        await asyncio.sleep(0.5)
        gc.collect()
        rss2 = _rss()
        timers = sup.waiting_timers
        assert not outcomes, "setup took longer than the margin"
        await asyncio.wait_for(done.wait(), 900)
        cpu = time.process_time() - cpu0
    assert all(o.status == "fired" for o in outcomes), outcomes[0]
    fired = sorted(o.fired_at for o in outcomes if o.fired_at is not None)
    lags = sorted((at - due).total_seconds() for at in fired)
    return {
        "case": case,
        "n": n,
        "timers": timers,
        "import_s": import_s,
        "import_mb": (rss1 - rss0) / 1e6,
        "bytes_per_trigger": (rss2 - rss1) / n,
        "due_to_all_fired_s": (fired[-1] - due).total_seconds(),
        "lag_p50_ms": _quantile(lags, 0.50) * 1000,
        "lag_p99_ms": _quantile(lags, 0.99) * 1000,
        "cpu_us_per_trigger": cpu / n * 1e6,
    }


def _packages_of(checkout: Path, into: Path) -> Path:
    """A directory that, first on PYTHONPATH, makes ``deferline`` the checkout's packages."""
    package = into / "deferline"
    package.mkdir()
    for name in PACKAGES:
        (package / name).symlink_to((checkout / name).resolve(), target_is_directory=True)
    return into


def _run(case: str, n: int, pythonpath: Path | None) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--n", str(n), "--json"]
    env = dict(os.environ)
    # The checkout's root, for bench._airflow_running_trigger; a --before's packages first.
    paths = [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
    if pythonpath is not None:
        paths.insert(0, str(pythonpath))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"case {case} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CLASSPATHS))
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--before", type=Path, help="a deferline checkout to compare with")
    parser.add_argument(
        "--coroutines",
        type=int,
        default=0,
        help="also N Airflow date-time triggers as coroutines, with and without Airflow "
        "services configured (and --before's, without)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line (internal)")
    args = parser.parse_args()
    if args.case:
        result = asyncio.run(measure(args.case, args.n))
        print(json.dumps(result) if args.json else result)
        return
    sitting = Sitting.begin("airflow_triggers")
    print(f"machine: {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"Apache Airflow {AIRFLOW_VERSION}")
    print()
    print(
        "| N due at once | DateTimeTrigger | code | in timer heap | first load (import) "
        "| bytes / waiting trigger | due → all fired | lag p50 | lag p99 | CPU / trigger |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        before = None if args.before is None else _packages_of(args.before, Path(scratch))
        cases: list[tuple[str, str, Path | None]] = [
            ("deferline", "this", None),
            ("airflow", "this", None),
        ]
        if before is not None:
            cases.insert(1, ("airflow", "before", before))
        if args.coroutines:
            if before is not None:
                cases.append(("airflow-run", "before", before))
            cases += [("airflow-run", "this", None), ("airflow-run-services", "this", None)]
        results = {}
        for case, code, pythonpath in cases:
            n = args.coroutines if case.startswith("airflow-run") else args.n
            r = results[case, code] = _run(case, n, pythonpath)
            print(
                f"| {n:,} | {case} | {code} | {r['timers']:,} "
                f"| {r['import_s']:.2f} s, {r['import_mb']:.0f} MB "
                f"| {r['bytes_per_trigger']:,.0f} B | {r['due_to_all_fired_s'] * 1000:,.0f} ms "
                f"| {r['lag_p50_ms']:.1f} ms | {r['lag_p99_ms']:.1f} ms "
                f"| {r['cpu_us_per_trigger']:.1f} µs |"
            )
    own = results["deferline", "this"]
    print()
    for (case, code), r in results.items():
        if case == "airflow":
            print(
                f"airflow ({code}) / deferline: "
                f"memory {r['bytes_per_trigger'] / own['bytes_per_trigger']:.2f}x, "
                f"CPU {r['cpu_us_per_trigger'] / own['cpu_us_per_trigger']:.2f}x"
            )
    sitting.write(_figures(results, args.n, args.coroutines))


def _figures(
    results: dict[tuple[str, str], dict[str, Any]], n: int, coroutines: int
) -> list[Figure]:
    """This build's claims per case; the ``--before`` build's figures go in their notes."""
    line = f"airflow{AIRFLOW_VERSION.split('.')[0]}"
    kinds = {
        "deferline": ("deferline_datetime", f"{n:,} of deferline's `DateTimeTrigger`"),
        "airflow": (
            f"{line}_datetime",
            f"{n:,} of Airflow {AIRFLOW_VERSION}'s own `DateTimeTrigger` under deferline's "
            "supervisor",
        ),
        "airflow-run": (
            f"{line}_coroutine",
            f"a waiting Airflow {AIRFLOW_VERSION} coroutine trigger ({coroutines:,}, asking "
            "nothing), services unset",
        ),
        "airflow-run-services": (
            f"{line}_coroutine_services",
            f"a waiting Airflow {AIRFLOW_VERSION} coroutine trigger ({coroutines:,}, asking "
            "nothing), `DEFERLINE_AIRFLOW_SERVICES` set",
        ),
    }
    figures = []
    for (case, code), r in results.items():
        if code != "this":
            continue
        slug, what = kinds[case]
        before = results.get((case, "before"))
        figures += [
            Figure(
                f"airflow_triggers.{slug}_memory",
                f"{what}: memory each",
                round(r["bytes_per_trigger"]),
                "B",
                note="" if before is None else f"--before: {before['bytes_per_trigger']:,.0f} B",
            ),
            Figure(
                f"airflow_triggers.{slug}_cpu",
                f"{what}: CPU each",
                round(r["cpu_us_per_trigger"], 1),
                "µs",
                note=f"due → all fired {r['due_to_all_fired_s']:.2f} s"
                + ("" if before is None else f"; --before: {before['cpu_us_per_trigger']:.1f} µs"),
            ),
        ]
        if case == "airflow":
            figures.append(
                Figure(
                    f"airflow_triggers.{line}_first_load",
                    f"first load of Airflow {AIRFLOW_VERSION}'s class (import as a library)",
                    round(r["import_s"], 2),
                    "s",
                    note=f"{r['import_mb']:.0f} MB",
                )
            )
    return figures


if __name__ == "__main__":
    main()
