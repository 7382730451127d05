"""An asset of team ``x`` watched by Airflow's FileDeleteTrigger: its watcher row is the team's."""

# mypy: ignore-errors
from __future__ import annotations

import os

from airflow.providers.standard.triggers.file import FileDeleteTrigger
from airflow.sdk import DAG, Asset, AssetWatcher, task

inbox = Asset(
    "team_x_inbox",
    watchers=[
        AssetWatcher(
            name="team_x_watcher",
            trigger=FileDeleteTrigger(
                filepath=os.path.join(os.environ["AIRFLOW_HOME"], "team_x_flag"), poke_interval=1
            ),
        )
    ],
)

with DAG(dag_id="features_team_x_watched", schedule=[inbox], catchup=False):

    @task
    def consume() -> str:
        return "consumed"

    consume()
