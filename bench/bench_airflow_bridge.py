"""N Airflow task instances due at one moment on PostgreSQL: Airflow's triggerer against the bridge.

The peer benchmark of ``deferline airflow bridge``. One PostgreSQL server (Debian's package,
temporary, or kept with ``--keep DIR`` so later runs reuse its seeded databases), one Airflow
schema (``airflow db migrate``), N task instances of one mapped ``DateTimeSensorAsync`` seeded
once through Airflow's own code as a deferral leaves them (tests/integration/_airflow_seed.py:
the DAG serialized, a DAG run, each task instance run and deferred through the Execution API's
handlers on Airflow 3, ``TaskInstance.defer_task`` on 2.10). Each contender then gets a copy of
that database (``CREATE DATABASE … TEMPLATE``), its deferrals re-timed to fall due
``--margin`` seconds later (one UPDATE of the trigger rows' kwargs with the value Airflow
writes for that moment), and starts:

- ``airflow``: Airflow's own ``airflow triggerer``, as configured by default;
- ``bridge-tansu`` / ``bridge-kafka``: ``deferline airflow bridge`` and one
  ``deferline triggerer`` on a Tansu or Apache Kafka broker;
- ``baseline-kafka``: the same, from another checkout of deferline (``--baseline DIR``, its
  packages first on ``PYTHONPATH``, this interpreter), to compare versions in one run; with
  ``--baseline`` given several times, each ``baseline-kafka`` takes the next in turn.

Clock: from the due moment until no task instance is ``deferred`` (polled every 20 ms: ``EXISTS``,
which stops at the first deferred row, not a count of them all).
Reported per contender: that time; for a bridge, when its triggerer's first and last events
reached the broker (record times on the resume topic: the firing apart from the write-back);
how many rows were claimed at the due moment; the CPU seconds from the due moment to the end
of each process (with its children; for a bridge: the bridge, its triggerer) and of
PostgreSQL's (all its processes: the time the database spent); the CPU per
resumed task of its main process (with its children: Airflow's triggerer runs its triggers in a
subprocess; the bridge's) and of all its processes (the bridge's with the deferline
triggerer's), from start to the end; the peak RSS of its main process; the one-minute load
average at the end. Runs on the Airflow line installed in the interpreter (``.venv``: Airflow
3; ``.venv-airflow2``: 2.10).

Run: .venv/bin/python -m bench.bench_airflow_bridge --n 10000 [--contenders airflow bridge-tansu]
     [--keep /var/tmp/bench-airflow]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.topics import TopicNames, stop_client
from sqlalchemy import create_engine, text

from bench._figures import Figure, Peer, Sitting, runs_figure, size_slug
from bench._harness import cpu_seconds, local_broker, machine_line, peak_rss_mb
from tests.airflow_line import STANDARD_TRIGGERS
from tests.integration import _airflow_seed as seeding
from tests.integration._postgres import PostgresServer, postgres_bin

CONTENDERS = ("airflow", "bridge-tansu", "bridge-kafka", "baseline-kafka")
PACKAGES = ("engine", "schemas", "topics", "runners", "replay", "client")
BIN = Path(sys.executable).parent
POLL_S = 0.02
_PREFIX = f"bench{os.getpid()}."


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


class Processes:
    """The processes of one contender: CPU of their trees, peak RSS of the first."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self._cpu: dict[tuple[int, int], float] = {}

    def start(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.procs.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log.open("wb"),
                start_new_session=True,
            )
        )

    def sample(self) -> None:
        """Remember each live process's CPU so far (a child may end before the end)."""
        for index, proc in enumerate(self.procs):
            for pid, cpu in _tree_cpu(proc.pid).items():
                self._cpu[index, pid] = cpu

    def each_cpu_seconds(self) -> list[float]:
        """CPU so far of each process started, with its children, in the order started."""
        return [self.cpu_seconds(i) for i in range(len(self.procs))]

    def cpu_seconds(self, index: int | None = None) -> float:
        """CPU of all the processes, or of the ``index``-th started and its children."""
        return sum(cpu for (i, _), cpu in self._cpu.items() if index in (None, i))

    def peak_rss_mb(self) -> float:
        return peak_rss_mb(self.procs[0].pid)

    def check(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")

    def stop(self) -> None:
        for proc in self.procs:
            seeding.stop_group(proc)


def _tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds so far of ``pid`` and of each process below it."""
    found: dict[int, float] = {}
    for each in _descendants(pid):
        with contextlib.suppress(OSError):
            found[each] = cpu_seconds(each)
    return found


def _start_airflow(
    processes: Processes, env: dict[str, str], workdir: Path, bootstrap: str
) -> None:
    processes.start([str(BIN / "airflow"), "triggerer"], env, workdir / "airflow-triggerer.log")


def _start_bridge(processes: Processes, env: dict[str, str], workdir: Path, bootstrap: str) -> None:
    """The bridge first (its main process is the one whose RSS is reported), then one
    triggerer on the bridge's topic prefix; Airflow's DateTimeTrigger allowed in both."""
    deferline = {
        **env,
        "DEFERLINE_ALLOWED_TRIGGER_PREFIXES": STANDARD_TRIGGERS,
        "DEFERLINE_COPY_EVENTS_TO_TASKS": "false",  # no deferline scheduler on this prefix
    }
    connection = ["--bootstrap-servers", bootstrap, "--topic-prefix", _PREFIX]
    quiet = ["--log-level", "WARNING"]
    level = ["--log-level", env.get("BENCH_BRIDGE_LOG_LEVEL", "WARNING"), "--log-format", "json"]
    bridge = [str(BIN / "deferline"), "airflow", "bridge", *connection, *level]
    processes.start([*bridge, "--bridge-prefix", connection[-1]], deferline, workdir / "bridge.log")
    state = ["--state-dir", str(workdir / "triggerer-state")]
    triggerer = [str(BIN / "deferline"), "triggerer", *connection, *state, *quiet]
    processes.start(triggerer, deferline, workdir / "triggerer.log")


def _start_baseline(
    processes: Processes, env: dict[str, str], workdir: Path, bootstrap: str
) -> None:
    """The bridge and triggerer of the ``--baseline`` checkout (``DEFERLINE_BASELINE``)."""
    shadow = workdir / "baseline"
    (shadow / "deferline").mkdir(parents=True)
    for package in PACKAGES:
        (shadow / "deferline" / package).symlink_to(Path(env["DEFERLINE_BASELINE"]) / package)
    path = os.pathsep.join(p for p in (str(shadow), env.get("PYTHONPATH")) if p)
    _start_bridge(processes, {**env, "PYTHONPATH": path}, workdir, bootstrap)


STARTERS: dict[str, Callable[[Processes, dict[str, str], Path, str], None]] = {
    "airflow": _start_airflow,
    "bridge-tansu": _start_bridge,
    "bridge-kafka": _start_bridge,
    "baseline-kafka": _start_baseline,
}


_TAIL = 64
"""Offsets before a resume partition's end read for its last event (markers come between)."""


async def _event_span(bootstrap: str, moment: dt.datetime) -> tuple[float, float] | None:
    """Seconds from ``moment`` to the first and to the last event on the bridge's resume
    topic, by the broker's record times: when the triggerer fired, apart from the write-back."""
    topic = TopicNames(_PREFIX).resume()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        cluster = await consumer._client.fetch_all_metadata()  # it subscribes to nothing
        tps = [TopicPartition(topic, p) for p in cluster.partitions_for_topic(topic) or ()]
        ends = await consumer.end_offsets(tps)
        tps = [tp for tp in tps if ends[tp] > 0]
        if not tps:
            return None
        consumer.assign(tps)
        firsts: list[int] = []
        for tp in tps:
            await consumer.seek_to_beginning(tp)
            firsts.append((await consumer.getone(tp)).timestamp)
        # The last record is not at the end offset less one: a triggerer writing in
        # transactions (Apache Kafka) ends each partition with a commit marker, no record.
        lasts: list[int] = []
        for tp in tps:
            consumer.seek(tp, max(0, ends[tp] - _TAIL))
            while await consumer.position(tp) < ends[tp]:
                batch = (await consumer.getmany(tp, timeout_ms=1000)).get(tp, [])
                lasts += [record.timestamp for record in batch]
        first, last = min(firsts), max(lasts)
    finally:
        await stop_client(consumer, grace=5.0, name="resume topic reader")
    due_ms = moment.timestamp() * 1000
    return (first - due_ms) / 1000, (last - due_ms) / 1000


def _database(contender: str) -> str:
    return "run_" + contender.replace("-", "_")


@contextlib.asynccontextmanager
async def _broker(contender: str) -> AsyncIterator[str]:
    if contender == "airflow":
        yield ""
        return
    async with local_broker(contender.split("-")[-1]) as bootstrap:
        yield bootstrap


@contextlib.contextmanager
def _postgres(keep: Path | None) -> Iterator[PostgresServer]:
    bin_dir = postgres_bin()
    if bin_dir is None:
        sys.exit("PostgreSQL's server is not installed (Debian: apt-get install postgresql)")
    server = PostgresServer(bin_dir, keep)
    try:
        yield server
    finally:
        server.close()


async def measure(
    server: PostgresServer,
    home: Path,
    seeded: str,
    contender: str,
    n: int,
    margin: float,
    limit: float,
    baseline: Path | None,
    bridge_log_level: str = "WARNING",
) -> dict[str, Any]:
    """One contender on a fresh copy of the seeded database."""
    url = server.create_database(_database(contender), template=seeded)
    env = seeding.airflow_env(home, url)
    if baseline is not None:
        env["DEFERLINE_BASELINE"] = str(baseline)
    env["BENCH_BRIDGE_LOG_LEVEL"] = bridge_log_level
    workdir = home / f"run-{contender}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir()
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    # Polled: whether any task instance is deferred, which stops at the first one found (a
    # count of 100,000 rows every 20 ms took a fifth of a core of PostgreSQL's time from the
    # contender); counted once, at the end.
    deferred = "FROM task_instance WHERE state = 'deferred'"
    query = text(f"SELECT EXISTS (SELECT 1 {deferred})")
    count = text(f"SELECT count(*) {deferred}")
    held = text("SELECT count(*) FROM trigger WHERE triggerer_id IS NOT NULL")
    processes = Processes()
    async with _broker(contender) as bootstrap:
        moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=margin)
        seeding.retime(env, moment)
        STARTERS[contender](processes, env, workdir, bootstrap)
        try:
            with engine.connect() as db:
                while time.time() < moment.timestamp():
                    processes.check()
                    processes.sample()
                    await asyncio.sleep(min(0.5, max(0.0, moment.timestamp() - time.time())))
                claimed = int(db.execute(held).scalar_one())
                processes.sample()
                at_due, postgres_at_due = processes.each_cpu_seconds(), _tree_cpu(server.pid)
                waiting = True
                while waiting and time.time() - moment.timestamp() < limit:
                    waiting = bool(db.execute(query).scalar_one())
                    if waiting:
                        processes.sample()
                        await asyncio.sleep(POLL_S)
                elapsed = time.time() - moment.timestamp()
                left = int(db.execute(count).scalar_one())
            processes.sample()
            postgres = _tree_cpu(server.pid)
            after_due = [
                end - due for end, due in zip(processes.each_cpu_seconds(), at_due, strict=True)
            ]
            after_due.append(
                sum(cpu - postgres_at_due.get(pid, 0.0) for pid, cpu in postgres.items())
            )
            span = await _event_span(bootstrap, moment) if bootstrap else None
            resumed = max(1, n - left)
            figures = {
                "contender": contender,
                **({"checkout": str(baseline)} if contender == "baseline-kafka" else {}),
                "n": n,
                "due_to_none_deferred_s": round(elapsed, 2),
                **(
                    {
                        "due_to_first_event_s": round(span[0], 2),
                        "due_to_last_event_s": round(span[1], 2),
                    }
                    if span
                    else {}
                ),
                "claimed_at_due": claimed,
                "left_deferred": left,
                "cpu_after_due_s": [round(cpu, 2) for cpu in after_due],
                "main_cpu_ms_per_task": round(1000 * processes.cpu_seconds(0) / resumed, 3),
                "all_cpu_ms_per_task": round(1000 * processes.cpu_seconds() / resumed, 3),
                "peak_rss_mb": round(processes.peak_rss_mb(), 1),
                "load_1min": round(os.getloadavg()[0], 1),
            }
        finally:
            processes.stop()
            engine.dispose()
    return figures


async def run(args: argparse.Namespace) -> None:
    sitting = Sitting.begin("airflow_bridge")
    measured: list[dict[str, Any]] = []
    version = importlib.metadata.version("apache-airflow")
    print(machine_line(), f"Airflow {version}, PostgreSQL from {postgres_bin()}")
    if "baseline-kafka" in args.contenders and not args.baseline:
        sys.exit("contender baseline-kafka needs --baseline DIR")
    keep = args.keep / f"airflow{version}" if args.keep else None
    with contextlib.ExitStack() as stack:
        temporary = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-airflow-")))
        home = keep / "home" if keep else temporary
        server = stack.enter_context(_postgres(keep and keep / "postgres"))
        if not server.has_database("migrated"):
            seeding.migrate(seeding.airflow_env(home, server.create_database("migrated")))
        for n in args.n:
            seeded = f"seeded_{n}"
            if not server.has_database(seeded):
                env = seeding.airflow_env(home, server.create_database(seeded, "migrated"))
                t0 = time.perf_counter()
                far = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
                seeding.seed(env, n, far, args.seed_workers)
                print(f"N={n}: seeded in {time.perf_counter() - t0:.0f} s", flush=True)
            # Statistics before the copies are made: a copy taken before autovacuum's
            # ANALYZE plans the write-back's UPDATE on (dag_id, state), a scan of every
            # deferred row per task instance.
            server.psql("ANALYZE", seeded)
            margin = args.margin if args.margin is not None else 10 + n / 2000
            baselines = itertools.cycle(args.baseline or [None])
            for contender in args.contenders:
                server.psql(f'DROP DATABASE IF EXISTS "{_database(contender)}"')
                baseline = next(baselines) if contender == "baseline-kafka" else None
                figures = await measure(
                    server,
                    home,
                    seeded,
                    contender,
                    n,
                    margin,
                    args.timeout,
                    baseline,
                    args.bridge_log_level,
                )
                print(figures, flush=True)
                measured.append(figures)
    for broker in ("kafka", "tansu"):
        sitting.write(_figures(version, broker, measured), broker=broker)


def _figures(version: str, broker: str, measured: list[dict[str, Any]]) -> list[Figure]:
    """Per N, the bridge on ``broker`` (median of its runs) beside `airflow triggerer`'s."""

    def times(n: int, contender: str) -> list[float]:
        return [
            f["due_to_none_deferred_s"]
            for f in measured
            if f["n"] == n and f["contender"] == contender
        ]

    figures = []
    for n in dict.fromkeys(f["n"] for f in measured):
        ours, airflow = times(n, f"bridge-{broker}"), times(n, "airflow")
        if not ours:
            continue
        baseline = times(n, "baseline-kafka") if broker == "kafka" else []
        cpu = [
            f["all_cpu_ms_per_task"]
            for f in measured
            if f["n"] == n and f["contender"] == f"bridge-{broker}"
        ]
        figures.append(
            runs_figure(
                f"bridge.airflow{version.split('.')[0]}.due_at_once_{size_slug(n)}",
                f"{n:,} Airflow {version} task instances on `DateTimeTrigger`s due at once, the "
                "bridge and one triggerer in place of `airflow triggerer` (PostgreSQL): due → "
                "none `deferred`",
                ours,
                "s",
                peer=Peer(
                    "`airflow triggerer`, same run",
                    " / ".join(f"{t:.1f}" for t in airflow) + " s",
                )
                if airflow
                else None,
                note=f"{min(cpu):.2f} to {max(cpu):.2f} ms CPU per task (bridge and triggerer)"
                + (f"; baseline: {', '.join(f'{t:.2f}' for t in baseline)} s" if baseline else ""),
            )
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, nargs="+", default=[10_000])
    parser.add_argument(
        "--contenders",
        nargs="*",
        choices=CONTENDERS,
        default=list(CONTENDERS),
        help="none: seed only",
    )
    parser.add_argument(
        "--margin", type=float, help="seconds from start to due (default 10 + N/2,000)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds after due")
    parser.add_argument("--seed-workers", type=int, default=2)
    parser.add_argument(
        "--bridge-log-level",
        default="WARNING",
        help="the bridge's --log-level (json, in run-<contender>/bridge.log under the home); "
        "DEBUG logs each claim loop and written batch with its timings",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        action="append",
        help="a checkout of another deferline version, run as contender baseline-kafka "
        "(several: each baseline-kafka takes the next)",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="keep PostgreSQL's data here and reuse its seeded databases in later runs",
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
