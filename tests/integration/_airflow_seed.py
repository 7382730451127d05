"""N Airflow task instances deferred on DateTimeTriggers due at one moment, as deferrals leave them.

Everything goes through Airflow's own code, on the line installed in the interpreter:

- a DAG file in the DAGs folder with one mapped ``DateTimeSensorAsync`` (``expand`` over N
  literal target times), parsed by ``DagBag`` and serialized to the database as the DAG
  processor does (Airflow 3: ``sync_bag_to_db``; 2.10: ``DAG.bulk_write_to_db`` and
  ``SerializedDagModel.write_dag``);
- one DAG run made by ``create_dagrun``, whose ``verify_integrity`` bulk-inserts the N mapped
  task instances (``bulk_insert_mappings``);
- the N scheduled by the scheduler's ``DagRun.schedule_tis`` (bulk UPDATEs: ``scheduled``,
  ``try_number`` 1), then queued at once with the scheduler's single ``UPDATE`` (state
  ``queued``, ``queued_dttm``), the one step not done by an Airflow function (the scheduler's
  own query also checks pools and concurrency, which would queue 16 at a time);
- Airflow 3: each task instance started and deferred through the Execution API's handlers
  (``ti_run``, then ``ti_update_state`` with the ``TIDeferredStatePayload`` the Task SDK's
  ``_defer_task`` sends for ``DateTimeSensorAsync.execute``), called in process with a
  database session, without HTTP (and without the API's JWT check). Airflow 2.10:
  ``TaskInstance.defer_task`` with the ``TaskDeferred`` that ``DateTimeSensorAsync.execute``
  raises, on task instances set ``running`` on the ORM object (the worker's own start,
  ``check_and_change_state_before_execution``, is not run), committed every ``BATCH``.

The per-task-instance steps run in ``workers`` processes, each a share of the map indexes.

Run in a process whose environment points Airflow at the database (``airflow_env``):
``python -m tests.integration._airflow_seed --n 10000 --moment 2026-11-25T16:00:00+00:00``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.airflow_line import airflow_line

DAG_ID = "deferline_due"
TASK_ID = "wait"
RUN_ID = "due"
BATCH = 1000
FERNET_KEY = "Iw6Ih0u-I2MOvO9l0ZOaPJw8pa8OCeoIx5fG2Ha6yXc="

_DAG_3 = """\
from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.sdk import DAG

with DAG({dag_id!r}, schedule=None, catchup=False):
    DateTimeSensorAsync.partial(task_id={task_id!r}).expand(target_time=[{moment!r}] * {n})
"""
_DAG_2 = """\
import pendulum
from airflow import DAG
from airflow.sensors.date_time import DateTimeSensorAsync

with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
    DateTimeSensorAsync.partial(task_id={task_id!r}).expand(target_time=[{moment!r}] * {n})
"""


def airflow_env(home: Path, url: str) -> dict[str, str]:
    """The environment of every Airflow process of one deployment: its home and database
    (not this process's ``_AIRFLOW__AS_LIBRARY``, set when a test loads Airflow's classes)."""
    inherited = {k: v for k, v in os.environ.items() if k != "_AIRFLOW__AS_LIBRARY"}
    return {
        **inherited,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": url,
        "AIRFLOW__CORE__FERNET_KEY": FERNET_KEY,
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__CORE__MAX_MAP_LENGTH": "1000000",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
    }


def migrate(env: dict[str, str]) -> None:
    """Create Airflow's schema in the environment's database (``airflow db migrate``)."""
    airflow = Path(sys.executable).with_name("airflow")
    done = subprocess.run([str(airflow), "db", "migrate"], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"airflow db migrate failed:\n{done.stdout}{done.stderr}")


def seed(env: dict[str, str], n: int, moment: dt.datetime, workers: int = 2) -> None:
    """Seed in subprocesses (Airflow reads its configuration once, at import): one makes the
    DAG, the run and its queued task instances, then ``workers`` defer a share each."""

    def run(*args: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", __name__, "--n", str(n), "--moment", moment.isoformat()]
        return subprocess.Popen([*command, *args], env=env, cwd=Path(__file__).parents[2])

    if run("--prepare").wait():
        raise RuntimeError("seeding failed: preparing the DAG run")
    deferring = [run("--part", str(i), "--parts", str(workers)) for i in range(workers)]
    if any([process.wait() for process in deferring]):
        raise RuntimeError("seeding failed: deferring the task instances")


def retime(env: dict[str, str], moment: dt.datetime, every: int = 1) -> None:
    """Move the deferrals' moment to ``moment``: the one trigger-kwargs value a deferral at
    ``moment`` writes (made by Airflow's code, see ``_kwargs_column``), set in one UPDATE on
    every trigger row, or on those whose id is a multiple of ``every``. A seeded database
    copied per run is thus due when the run wants it."""
    command = [sys.executable, "-m", __name__, "--n", "0", "--moment", moment.isoformat()]
    command += ["--retime", "--every", str(every)]
    subprocess.run(command, env=env, cwd=Path(__file__).parents[2], check=True)


def stop_group(*procs: subprocess.Popen[Any], grace: float = 30.0) -> None:
    """Stop processes started with ``start_new_session`` and all they started: SIGTERM to
    every group at once; then, as each leader ends (or after ``grace`` seconds, when it is
    killed), SIGKILL to what is left of its group. Airflow's triggerer runs its triggers in a
    child process, and a scheduler's LocalExecutor workers and log server outlive it."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with contextlib.suppress(ProcessLookupError):  # the group is empty: all ended
            os.killpg(proc.pid, signal.SIGKILL)


def _dag_file() -> Path:
    return Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"]) / f"{DAG_ID}.py"


def _write_dag(n: int, moment: dt.datetime) -> Path:
    source = _DAG_3 if airflow_line() >= 3 else _DAG_2
    path = _dag_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source.format(dag_id=DAG_ID, task_id=TASK_ID, moment=moment.isoformat(), n=n))
    return path


def _schedule_and_queue(task: Any) -> None:
    """Schedule the run's task instances as the scheduler does (``DagRun.schedule_tis``:
    state ``scheduled``, ``try_number`` + 1, in bulk), then queue them all with the scheduler's
    UPDATE."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import select, update

    ours = (TI.dag_id == DAG_ID) & (TI.run_id == RUN_ID)
    with create_session() as session:
        run = session.scalars(select(DagRun).where(DagRun.run_id == RUN_ID)).one()
        tis = session.scalars(select(TI).where(ours)).all()
        for ti in tis:
            ti.task = task
        run.schedule_tis(tis, session=session, max_tis_per_query=BATCH)
        session.execute(
            update(TI)
            .where(ours)
            .values(state=TaskInstanceState.QUEUED, queued_dttm=dt.datetime.now(dt.UTC))
            .execution_options(synchronize_session=False)
        )


def _share(part: int, parts: int) -> Any:
    """The WHERE clause of one deferring process's share of the run's task instances."""
    from airflow.models.taskinstance import TaskInstance as TI

    return (TI.dag_id == DAG_ID) & (TI.run_id == RUN_ID) & (TI.map_index % parts == part)


def _prepare_3(n: int, moment: dt.datetime) -> None:
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from airflow.models.dagbag import DBDagBag
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType

    path = _write_dag(n, moment)
    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(DagBag(dag_folder=path, bundle_name="dags-folder"), "dags-folder", None)
    with create_session() as session:
        dag = DBDagBag().get_latest_version_of_dag(DAG_ID, session=session)
        dag.create_dagrun(
            run_id=RUN_ID,
            run_after=dt.datetime.now(dt.UTC),
            run_type=DagRunType.MANUAL,
            triggered_by=DagRunTriggeredByType.TEST,
            state=DagRunState.RUNNING,
            session=session,
        )
    _schedule_and_queue(dag.get_task(TASK_ID))


class _Token:
    """ti_run reads only the token's scope (a worker's execution token)."""

    class claims:  # the attribute path ti_run reads
        scope = "execution"


_CLASSPATH_3 = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"


def _trigger_kwargs_3(moment: dt.datetime) -> dict[str, Any]:
    """What the Task SDK's ``_defer_task`` sends for ``DateTimeSensorAsync.execute``."""
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger
    from airflow.sdk.serde import serialize

    classpath, kwargs = DateTimeTrigger(moment=moment, end_from_trigger=False).serialize()
    assert classpath == _CLASSPATH_3
    serialized: dict[str, Any] = serialize(kwargs)
    return serialized


def _kwargs_column(moment: dt.datetime) -> str:
    """The ``trigger.kwargs`` column a deferral until ``moment`` writes: on Airflow 3 the Task
    SDK's dict as JSON (``ti_update_state`` stores it so), on 2.10 ``Trigger.from_object``'s
    encrypted form."""
    if airflow_line() >= 3:
        return json.dumps(_trigger_kwargs_3(moment))
    from airflow.models.trigger import Trigger
    from airflow.triggers.temporal import DateTimeTrigger

    column: str = Trigger.from_object(DateTimeTrigger(moment=moment)).encrypted_kwargs
    return column


def _retime(moment: dt.datetime, every: int) -> None:
    from airflow.models.trigger import Trigger
    from airflow.utils.session import create_session
    from sqlalchemy import update

    rows = update(Trigger).where(Trigger.id % every == 0)
    with create_session() as session:
        session.execute(rows.values(encrypted_kwargs=_kwargs_column(moment)))


def _defer_3(moment: dt.datetime, part: int, parts: int) -> None:
    from airflow.api_fastapi.execution_api.datamodels.taskinstance import (
        TIDeferredStatePayload,
        TIEnterRunningPayload,
    )
    from airflow.api_fastapi.execution_api.routes.task_instances import ti_run, ti_update_state
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.sdk.serde import serialize as serde_serialize
    from airflow.utils.session import create_session
    from fastapi import Response
    from sqlalchemy import select

    defer = TIDeferredStatePayload(
        state="deferred",
        classpath=_CLASSPATH_3,
        trigger_kwargs=_trigger_kwargs_3(moment),
        next_method="execute_complete",
        next_kwargs=serde_serialize({}),
    )
    hostname = os.uname().nodename
    with create_session() as session:
        ids = session.scalars(select(TI.id).where(_share(part, parts)).order_by(TI.map_index)).all()
        session.commit()
        for ti_id in ids:
            start = TIEnterRunningPayload(
                state="running",
                hostname=hostname,
                unixname="airflow",
                pid=os.getpid(),
                start_date=dt.datetime.now(dt.UTC),
            )
            ti_run(ti_id, start, Response(), session, None, None, _Token())
            ti_update_state(ti_id, defer, session, None)  # commits


def _prepare_2(n: int, moment: dt.datetime) -> None:
    from airflow.models.dag import DAG
    from airflow.models.dagbag import DagBag
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunType

    path = _write_dag(n, moment)
    dag = DagBag(dag_folder=str(path), include_examples=False).get_dag(DAG_ID)
    DAG.bulk_write_to_db([dag])
    SerializedDagModel.write_dag(dag)
    when = dt.datetime.now(dt.UTC)
    dag.create_dagrun(
        run_id=RUN_ID,
        execution_date=when,
        data_interval=(when, when),
        run_type=DagRunType.MANUAL,
        state=DagRunState.RUNNING,
    )
    _schedule_and_queue(dag.get_task(TASK_ID))


def _defer_2(moment: dt.datetime, part: int, parts: int) -> None:
    from airflow.exceptions import TaskDeferred
    from airflow.models.dagbag import DagBag
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.triggers.temporal import DateTimeTrigger
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import select

    dags = DagBag(dag_folder=str(_dag_file()), include_examples=False)
    task = dags.get_dag(DAG_ID).get_task(TASK_ID)
    with create_session() as session:
        tis = session.scalars(select(TI).where(_share(part, parts)).order_by(TI.map_index)).all()
        for i, ti in enumerate(tis, 1):
            ti.task = task
            ti.state = TaskInstanceState.RUNNING
            ti.start_date = dt.datetime.now(dt.UTC)
            # What DateTimeSensorAsync.execute raises.
            deferral = TaskDeferred(
                trigger=DateTimeTrigger(moment=moment), method_name="execute_complete"
            )
            ti.defer_task(exception=deferral, session=session)
            if i % BATCH == 0:
                session.commit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--moment", type=dt.datetime.fromisoformat, required=True)
    parser.add_argument("--prepare", action="store_true", help="the DAG, its run, queued TIs")
    parser.add_argument("--part", type=int, default=0, help="defer the TIs of this share")
    parser.add_argument("--parts", type=int, default=1)
    parser.add_argument("--retime", action="store_true", help="move the deferrals' moment")
    parser.add_argument("--every", type=int, default=1, help="retime ids multiple of this")
    args = parser.parse_args()
    three = airflow_line() >= 3
    if args.retime:
        _retime(args.moment, args.every)
    elif args.prepare:
        (_prepare_3 if three else _prepare_2)(args.n, args.moment)
    else:
        (_defer_3 if three else _defer_2)(args.moment, args.part, args.parts)


if __name__ == "__main__":
    main()
