"""DAGs of the bridge's feature tests (trigger queues, start_from_trigger), in no team."""

# mypy: ignore-errors
from __future__ import annotations

import datetime as dt

from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.sdk import DAG
from features_ops import DefersFromWorker, StartsFromTrigger

ARGS = {"retries": 0}
START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

# With `[triggerer] queues_enabled`, a deferral's trigger row takes its task's queue.
with DAG(dag_id="features_queues", schedule=None, start_date=START, default_args=ARGS):
    DefersFromWorker(task_id="on_a_1", queue="a")
    DefersFromWorker(task_id="on_a_2", queue="a")
    # Served only once queue a's tasks are done, 15 s and more after this one deferred.
    DefersFromWorker(task_id="on_b", queue="b", delay=1)

with DAG(dag_id="features_start_from_trigger", schedule=None, start_date=START, default_args=ARGS):
    StartsFromTrigger(task_id="resumes_on_a_worker")
    StartsFromTrigger(task_id="ends_in_the_trigger", end_from_trigger=True)
    # Airflow's own sensor, started from its trigger: a moment passed, it fires at once.
    DateTimeSensorAsync(
        task_id="sensor_moment_passed",
        target_time="2026-01-01T00:00:00+00:00",
        start_from_trigger=True,
    )
    # Templated trigger kwargs: rendered with the task's context before the trigger runs, as
    # Airflow's triggerer renders them; one reads a variable stored in Airflow's database; one
    # names what the context lacks.
    DateTimeSensorAsync(
        task_id="sensor_templated",
        target_time="{{ dag_run.run_after.isoformat() }}",
        start_from_trigger=True,
    )
    DateTimeSensorAsync(
        task_id="sensor_templated_variable",
        target_time="{{ var.value.features_moment }}",
        start_from_trigger=True,
    )
    DateTimeSensorAsync(
        task_id="sensor_template_error",
        target_time="{{ no_such_thing.isoformat() }}",
        start_from_trigger=True,
    )

# The team test's neighbour: deferred from a worker, in no team; served only once the team's
# task is done, 15 s and more after this one deferred.
with DAG(dag_id="features_no_team", schedule=None, start_date=START, default_args=ARGS):
    DefersFromWorker(task_id="no_team", delay=1)
