"""The bridge's write-back of N fired events into Airflow's database, against Airflow's own.

N task instances are deferred through a real Airflow deployment on SQLite (Airflow 3: its
scheduler, DAG processor, API server and LocalExecutor run a mapped task of N that defers on
a ``DateTimeTrigger`` an hour away; no triggerer runs). The database is then copied twice and
one fired event per task instance is written to each copy, in a fresh process each:

* ``airflow``: ``Trigger.submit_event`` once per event, each in its own session and commit,
  as Airflow's triggerer writes them (``handle_events``);
* ``bridge``: the bridge's ``AirflowDatabase.apply`` in batches of ``--batch`` events.

``--before DIR`` also writes a third copy with the bridge's code of the deferline checkout DIR
(``before``), for a before/after of the same run.

Reported per way: wall-clock seconds, the process's CPU seconds, events per second, and the
task instances left ``deferred`` (0 both ways). SQLite only; the peer benchmark on PostgreSQL
(Airflow's triggerer against the bridge and a deferline triggerer, due → none deferred) is
another script.

Run: .venv/bin/python -m bench.bench_airflow_writeback [--n 300] [--batch 5000] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._figures import Figure, Peer, Sitting, size_slug
from bench.bench_airflow_triggers import _packages_of
from tests.integration._airflow_deployment import AirflowDeployment

DAG_ID = "bench_writeback"
DAG = """
import datetime as dt
from airflow.providers.standard.triggers.temporal import DateTimeTrigger
from airflow.sdk import DAG, BaseOperator

class WaitsAnHour(BaseOperator):
    def __init__(self, *, n, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def execute(self, context):
        later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        self.defer(trigger=DateTimeTrigger(moment=later), method_name="execute_complete")

    def execute_complete(self, context, event=None):
        return None

with DAG(dag_id="%s", schedule=None, start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC)):
    WaitsAnHour.partial(task_id="wait").expand(n=list(range(%d)))
"""


def apply(way: str, batch: int) -> dict[str, float]:
    """In a process of its own, with Airflow's database the copy to write."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.models.trigger import Trigger
    from airflow.triggers.base import TriggerEvent
    from deferline.runners.airflow_bridge.testing import AirflowDatabase, BridgeEvent, RowRef
    from sqlalchemy import func, select

    db = AirflowDatabase(queues=None, team_name=None)
    with db._session() as session:
        rows = session.execute(
            select(TI.map_index, Trigger.id, Trigger.created_date)
            .join(Trigger, Trigger.id == TI.trigger_id)
            .where(TI.dag_id == DAG_ID)
        ).all()
    events = [BridgeEvent(RowRef.of(i, c), "fired", payload={"n": n}) for n, i, c in rows]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if way == "airflow":
        for event in events:
            Trigger.submit_event(event.ref.row_id, TriggerEvent(event.payload))
    else:
        for start in range(0, len(events), batch):
            db.apply(events[start : start + batch])
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    with db._session() as session:
        left = session.scalar(
            select(func.count()).where(TI.dag_id == DAG_ID, TI.state == "deferred")
        )
    return {"events": len(events), "seconds": wall, "cpu_seconds": cpu, "left_deferred": left}


def seed(home: Path, n: int) -> AirflowDeployment:
    af = AirflowDeployment(home)
    (af.dags / "bench_writeback_dag.py").write_text(DAG % (DAG_ID, n))
    af.start()
    af.wait_for("SELECT dag_id FROM dag WHERE dag_id = ?", DAG_ID)
    af.run("dags", "trigger", DAG_ID, "--run-id", "bench")
    deadline = time.monotonic() + 60 + n * 2.0
    while True:
        rows = af.query(
            "SELECT count(*) FROM task_instance WHERE dag_id = ? AND state = 'deferred'", DAG_ID
        )
        if rows[0][0] == n:
            return af
        if time.monotonic() > deadline:
            af.close()
            raise TimeoutError(f"{rows[0][0]} of {n} task instances deferred")
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--before", type=Path, help="a deferline checkout to compare with")
    parser.add_argument("--apply", choices=["airflow", "bridge"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.apply:
        print(json.dumps(apply(args.apply, args.batch)))
        return
    sitting = Sitting.begin("airflow_writeback")
    per_event_us: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "airflow"
        home.mkdir()
        started = time.perf_counter()
        af = seed(home, args.n)
        try:
            snapshot = Path(tmp) / "deferred.db"
            af.snapshot(snapshot)
        finally:
            af.close()
        print(f"{args.n} task instances deferred in {time.perf_counter() - started:.0f} s")
        ways = ["airflow", "bridge"]
        if args.before is not None:
            ways.insert(1, "before")
            before = _packages_of(args.before, Path(tempfile.mkdtemp(dir=tmp)))
        for way in ways:
            copy = Path(tmp) / f"{way}.db"
            shutil.copy(snapshot, copy)
            env = {**af.env, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{copy}"}
            env["AIRFLOW__LOGGING__LOGGING_LEVEL"] = "WARNING"
            if way == "before":
                env["PYTHONPATH"] = str(before)
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.bench_airflow_writeback",
                    "--apply",
                    "airflow" if way == "airflow" else "bridge",
                    "--batch",
                    str(args.batch),
                ],
                env=env,
                capture_output=True,
                check=True,
                cwd=Path(__file__).parents[1],
            )
            result = json.loads(done.stdout.decode().strip().splitlines()[-1])
            rate = result["events"] / result["seconds"]
            per_event_us[way] = result["seconds"] / max(1, result["events"]) * 1e6
            print(
                f"{way:8} {result['events']} events: {result['seconds']:.3f} s, "
                f"{result['cpu_seconds']:.3f} CPU-s, {rate:,.0f}/s, "
                f"{result['left_deferred']} left deferred"
            )
    print(f"({platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()})")
    before_us = per_event_us.get("before")
    sitting.write(
        [
            Figure(
                f"writeback.bulk_update_{size_slug(args.n)}",
                f"write-back of {args.n:,} fired events, Airflow on SQLite: the bridge, per event",
                round(per_event_us["bridge"]),
                "µs",
                peer=Peer("Airflow's `submit_event`, same run", round(per_event_us["airflow"])),
                note="" if before_us is None else f"--before: {before_us:,.0f} µs",
            )
        ]
    )


if __name__ == "__main__":
    main()
