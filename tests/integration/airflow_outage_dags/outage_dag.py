"""The lost-cluster test's DAG: date-time sensors due one after another, at the times the
run's conf gives (``{"at": [iso, ...]}``), so some fire before, during and after an outage."""

# mypy: ignore-errors
from __future__ import annotations

import datetime as dt

from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.sdk import DAG

TASKS = 8

with DAG("outage", schedule=None, start_date=dt.datetime(2024, 1, 1), catchup=False):
    for i in range(TASKS):
        DateTimeSensorAsync(task_id=f"wait_{i}", target_time=f"{{{{ dag_run.conf['at'][{i}] }}}}")
