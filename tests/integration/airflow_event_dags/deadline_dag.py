"""A DAG that misses its deadline: two deadline alerts, one callback allowed, one not."""

from __future__ import annotations

import datetime as dt
import time

from airflow.sdk import DAG, task
from airflow.sdk.definitions.callback import AsyncCallback
from airflow.sdk.definitions.deadline import DeadlineAlert, DeadlineReference


def alert(path: str) -> DeadlineAlert:
    return DeadlineAlert(
        reference=DeadlineReference.DAGRUN_QUEUED_AT,
        interval=dt.timedelta(seconds=1),
        callback=AsyncCallback(path, kwargs={"to": "ops"}),
    )


with DAG(
    dag_id="deadlined",
    schedule=None,
    catchup=False,
    deadline=[alert("deadline_callbacks.page"), alert("forbidden_callbacks.page")],
):

    @task
    def slow() -> None:
        time.sleep(20)

    slow()
