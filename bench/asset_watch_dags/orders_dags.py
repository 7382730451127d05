"""Two assets, each watched by deferline's Kafka topic watcher on its own topic: one for each
contender of bench.bench_asset_watchers."""

from __future__ import annotations

import os

from airflow.sdk import DAG, Asset, AssetWatcher, task
from deferline.engine.triggers.airflow import KafkaWatchTrigger

for contender in ("airflow", "deferline"):
    topic = os.environ[f"BENCH_TOPIC_{contender.upper()}"]
    orders = Asset(
        f"orders_{contender}",
        watchers=[
            AssetWatcher(
                name=f"orders_{contender}",
                trigger=KafkaWatchTrigger(topic=topic, group=f"{topic}-watch"),
            )
        ],
    )
    with DAG(dag_id=f"on_orders_{contender}", schedule=[orders], max_active_runs=1):

        @task
        def consume() -> None:
            pass

        consume()
