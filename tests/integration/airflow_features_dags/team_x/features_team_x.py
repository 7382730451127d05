"""The team test's DAG, in the bundle of team ``x``."""

# mypy: ignore-errors
from __future__ import annotations

import datetime as dt

from airflow.sdk import DAG
from features_ops import DefersFromWorker

with DAG(
    dag_id="features_team_x",
    schedule=None,
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    default_args={"retries": 0},
):
    DefersFromWorker(task_id="in_team_x")
