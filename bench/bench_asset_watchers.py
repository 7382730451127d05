"""Asset events from one Kafka topic watcher: ``airflow triggerer`` against the bridge.

    python -m bench.bench_asset_watchers [--n 2000] [--runs 2]

One Airflow 3 deployment (scheduler, DAG processor, API server, LocalExecutor, SQLite: the
tests' ``AirflowDeployment``), Apache Kafka from its jars. Two assets, each watched by
``deferline.engine.triggers.airflow.KafkaWatchTrigger`` on its own topic, each scheduling a
DAG of one empty task (``bench/asset_watch_dags``). Each run, for each contender in turn:
``--n`` messages are written to its topic, then the contender starts and works through them
until its asset has ``--n`` more asset events in Airflow's database; then it is stopped.

- ``airflow``: ``airflow triggerer`` (the watcher's ``run()``, committing each offset after
  its event);
- ``bridge``: ``deferline airflow bridge`` and one ``deferline triggerer`` (the offsets
  committed in the events' transactions; each event applied with its id recorded).

Reported: asset events per second between the run's first and last asset event (their
``timestamp`` column: the contender's own rate, its start left out), and the seconds from the
contender's start to its last event.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka.admin import NewTopic
from deferline.topics import Settings, make_admin, make_producer

from bench._figures import Peer, Sitting, runs_figure, size_slug
from bench._harness import local_broker, machine_line
from tests.integration._airflow_deployment import AirflowDeployment
from tests.integration._airflow_processes import Processes

DAGS = Path(__file__).with_name("asset_watch_dags")


def events(af: AirflowDeployment, contender: str, after: int) -> list[tuple[int, dt.datetime]]:
    """(id, timestamp) of the asset events of ``contender``'s asset with an id past ``after``."""
    rows = af.query(
        "SELECT e.id, e.timestamp FROM asset_event e JOIN asset a ON a.id = e.asset_id "
        "WHERE a.name = ? AND e.id > ? ORDER BY e.id",
        f"orders_{contender}",
        after,
    )
    return [(int(str(i)), dt.datetime.fromisoformat(str(t))) for i, t in rows]


async def write(settings: Settings, topic: str, n: int, run: int) -> None:
    producer = make_producer(settings, linger_ms=5)
    await producer.start()
    try:
        sends = [
            await producer.send(topic, f'{{"run": {run}, "n": {i}}}'.encode(), key=str(i).encode())
            for i in range(n)
        ]
        await asyncio.gather(*sends)
    finally:
        await producer.stop()


async def one(
    af: AirflowDeployment, settings: Settings, workdir: Path, contender: str, n: int, run: int
) -> dict[str, float]:
    before = events(af, contender, 0)
    last_id = before[-1][0] if before else 0
    await write(settings, os.environ[f"BENCH_TOPIC_{contender.upper()}"], n, run)
    start_wall = dt.datetime.now(dt.UTC)
    start = time.monotonic()
    processes = Processes(settings, af, workdir)
    triggerer = None
    if contender == "airflow":
        triggerer = af.spawn("triggerer")
    else:
        processes.bridge(f"bridge-{run}")
        processes.triggerer(f"triggerer-{run}")
    try:
        deadline = start + 600
        while True:
            got = await asyncio.to_thread(events, af, contender, last_id)
            if len(got) >= n or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    finally:
        if triggerer is not None:
            triggerer.terminate()
            triggerer.wait(60)
        processes.close()
    assert len(got) == n, f"{contender}: {len(got)} asset events of {n}"
    first, last = got[0][1], got[-1][1]
    if first.tzinfo is None:  # SQLite keeps UTC without an offset
        first, last = first.replace(tzinfo=dt.UTC), last.replace(tzinfo=dt.UTC)
    span = max((last - first).total_seconds(), 1e-3)
    result = {"per_s": (n - 1) / span, "to_last_s": (last - start_wall).total_seconds()}
    print(
        f"run {run} {contender}: {n:,} asset events, {result['per_s']:,.0f}/s between the first "
        f"and the last, the last {result['to_last_s']:.1f} s after the start"
    )
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    sitting = Sitting.begin("asset_watchers", broker="kafka")
    print(machine_line())
    results: dict[str, list[dict[str, float]]] = {"airflow": [], "bridge": []}
    with tempfile.TemporaryDirectory() as tmp:
        async with local_broker("kafka") as bootstrap:
            settings = Settings(
                bootstrap_servers=bootstrap, topic_prefix=f"b{uuid.uuid4().hex[:8]}.", partitions=4
            )
            topics = {c: f"{settings.topic_prefix}orders-{c}" for c in ("airflow", "deferline")}
            admin = make_admin(settings)
            await admin.start()
            await admin.create_topics(
                [NewTopic(t, num_partitions=3, replication_factor=1) for t in topics.values()]
            )
            await admin.close()
            for contender, topic in topics.items():
                os.environ[f"BENCH_TOPIC_{contender.upper()}"] = topic
            env: dict[str, Any] = {
                **{f"BENCH_TOPIC_{c.upper()}": t for c, t in topics.items()},
                "DEFERLINE_BOOTSTRAP_SERVERS": bootstrap,
                "DEFERLINE_COPY_EVENTS_TO_TASKS": "false",
                "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "5",
            }
            af = AirflowDeployment(Path(tmp) / "airflow", extra_env=env, dags_from=DAGS)
            try:
                af.start()
                af.wait_for("SELECT count(*) FROM asset_watcher HAVING count(*) = 2", within=180)
                for run in range(args.runs):
                    for contender in ("airflow", "bridge"):
                        topic_of = "airflow" if contender == "airflow" else "deferline"
                        got = await one(af, settings, Path(tmp), topic_of, args.n, run)
                        results[contender].append(got)
            finally:
                af.close()
    slug = size_slug(args.n)
    peer = sorted(r["per_s"] for r in results["airflow"])[len(results["airflow"]) // 2]
    peer_last = sorted(r["to_last_s"] for r in results["airflow"])[len(results["airflow"]) // 2]
    sitting.write(
        [
            runs_figure(
                f"asset_watchers.events_per_s_{slug}",
                f"{args.n:,} messages on a watched topic: asset events per second in Airflow "
                "(bridge and one deferline triggerer)",
                [round(r["per_s"]) for r in results["bridge"]],
                "/s",
                peer=Peer("airflow triggerer, same deployment, same run", round(peer)),
                note="between the run's first and last asset event; SQLite",
            ),
            runs_figure(
                f"asset_watchers.to_last_s_{slug}",
                f"{args.n:,} messages on a watched topic: from the start of the processes to "
                "the last asset event",
                [round(r["to_last_s"], 2) for r in results["bridge"]],
                "s",
                peer=Peer("airflow triggerer, same deployment, same run", round(peer_last, 2)),
            ),
        ]
    )


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
