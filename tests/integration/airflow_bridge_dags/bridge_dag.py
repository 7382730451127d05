"""The bridge's test DAG: deferrable tasks whose triggers run in deferline, not in Airflow."""

# mypy: ignore-errors
from __future__ import annotations

import datetime as dt
import os
from typing import Any

from bridge_forbidden import ForbiddenTrigger
from bridge_triggers import FailingTrigger, RenamedTrigger, WaitForeverTrigger

try:  # Airflow 3
    from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
    from airflow.providers.standard.sensors.time_delta import TimeDeltaSensor
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger
    from airflow.sdk import DAG, BaseOperator

    def timedelta_sensor(**kwargs: Any) -> BaseOperator:
        return TimeDeltaSensor(deferrable=True, **kwargs)

except ImportError:  # Airflow 2.10
    from airflow import DAG
    from airflow.models.baseoperator import BaseOperator
    from airflow.sensors.date_time import DateTimeSensorAsync
    from airflow.sensors.time_delta import TimeDeltaSensorAsync
    from airflow.triggers.temporal import DateTimeTrigger

    def timedelta_sensor(**kwargs: Any) -> BaseOperator:
        return TimeDeltaSensorAsync(**kwargs)


from airflow.providers.http.sensors.http import HttpSensor

MARKER = os.environ.get("BRIDGE_TEST_KILL_MARKER", "/tmp/bridge-on-kill")
# No trigger fires sooner than this after its task deferred: Airflow's scheduler fails a task
# resumed and running again before it has read the executor's report of the run that
# deferred (a race of Airflow's own, whichever triggerer resumes the task; docs/airflow.md).
RESUME_AFTER = 15


class FailsOperator(BaseOperator):
    def execute(self, context: Any) -> None:
        self.defer(trigger=FailingTrigger(RESUME_AFTER), method_name="execute_complete")

    def execute_complete(self, context: Any, event: Any = None) -> None:
        return None


class TimesOutOperator(BaseOperator):
    def execute(self, context: Any) -> None:
        later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        self.defer(
            trigger=DateTimeTrigger(moment=later),
            method_name="execute_complete",
            timeout=dt.timedelta(seconds=RESUME_AFTER),
        )

    def execute_complete(self, context: Any, event: Any = None) -> None:
        return None


class DefersOn(BaseOperator):
    """Defers on the trigger ``make()`` builds (the bad-input DAG's tasks)."""

    def __init__(self, *, make: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.make = make

    def execute(self, context: Any) -> None:
        self.defer(trigger=self.make(), method_name="execute_complete")

    def execute_complete(self, context: Any, event: Any = None) -> None:
        return None


def _in(seconds: float) -> DateTimeTrigger:
    return DateTimeTrigger(moment=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds))


class ClearedOperator(BaseOperator):
    """Waits forever on its first try; after a clear, its next try succeeds at once."""

    def execute(self, context: Any) -> str | None:
        if context["ti"].try_number > 1:
            return "cleared, then run again"
        self.defer(trigger=WaitForeverTrigger(MARKER), method_name="execute_complete")
        return None

    def execute_complete(self, context: Any, event: Any = None) -> None:
        return None


with DAG(
    dag_id="bridge_test",
    schedule=None,
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    default_args={"retries": 0},
):
    DateTimeSensorAsync(
        task_id="wait_datetime",
        target_time="{{ (macros.datetime.utcnow() + macros.timedelta(seconds=15)).isoformat() }}",
    )
    timedelta_sensor(task_id="wait_timedelta", delta=dt.timedelta(seconds=40))
    HttpSensor(
        task_id="wait_http",
        http_conn_id="bridge_test_api",
        endpoint="ready",
        deferrable=True,
        poke_interval=1,
    )
    FailsOperator(task_id="trigger_fails")
    TimesOutOperator(task_id="trigger_times_out")
    ClearedOperator(task_id="cleared_while_deferred")


# Deferred before any bridge runs; the test then corrupts one row's kwargs and starts one.
with DAG(
    dag_id="bridge_bad_input",
    schedule=None,
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    default_args={"retries": 0},
):
    DefersOn(task_id="class_not_allowed", make=ForbiddenTrigger)
    DefersOn(task_id="kwargs_undecryptable", make=lambda: _in(3600))
    DefersOn(task_id="class_missing", make=RenamedTrigger)
    DefersOn(task_id="good_neighbour", make=lambda: _in(RESUME_AFTER))
