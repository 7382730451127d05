"""An asset watched by deferline's Kafka topic watcher, and the DAG it schedules."""

from __future__ import annotations

import os

from airflow.sdk import DAG, Asset, AssetWatcher, task
from deferline.engine.triggers.airflow import KafkaWatchTrigger

orders = Asset(
    "kafka_orders",
    watchers=[
        AssetWatcher(
            name="orders_watcher",
            trigger=KafkaWatchTrigger(
                topic=os.environ["WATCH_TOPIC"],
                group=f"{os.environ['WATCH_TOPIC']}-watch",
                match={"kind": "order"},
            ),
        )
    ],
)

with DAG(dag_id="kafka_watched", schedule=[orders], catchup=False, max_active_runs=1):

    @task
    def consume() -> str:
        return "consumed"

    consume()
