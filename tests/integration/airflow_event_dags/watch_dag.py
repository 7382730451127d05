"""An asset watched by Airflow's FileDeleteTrigger, and the DAG it schedules."""

from __future__ import annotations

import os

from airflow.providers.standard.triggers.file import FileDeleteTrigger
from airflow.sdk import DAG, Asset, AssetWatcher, task

FLAG = os.path.join(os.environ["WATCH_INBOX"], "flag")

inbox = Asset(
    "watched_inbox",
    watchers=[
        AssetWatcher(
            name="inbox_watcher", trigger=FileDeleteTrigger(filepath=FLAG, poke_interval=0.2)
        )
    ],
)

with DAG(dag_id="watched", schedule=[inbox], catchup=False):

    @task
    def consume() -> str:
        return "consumed"

    consume()
