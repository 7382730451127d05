"""A real Airflow deployment on SQLite for the bridge's tests: its own processes, no triggerer.

Airflow 3: ``airflow scheduler``, ``airflow dag-processor`` and ``airflow api-server`` (the
Execution API its LocalExecutor's workers talk to). Airflow 2.10: ``airflow scheduler``
alone, with the SequentialExecutor (2.10 refuses any other executor on SQLite). Every
process reads the same environment (AIRFLOW_HOME, AIRFLOW__*), as a deployment's do.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from cryptography.fernet import Fernet
from deferline.topics import free_port

from tests._until import until_sync
from tests.airflow_line import airflow_line
from tests.integration._airflow_seed import stop_group

DAGS = Path(__file__).with_name("airflow_bridge_dags")
AIRFLOW = str(Path(sys.executable).with_name("airflow"))


# One key for the deployments of a test process, so they can share one migrated database.
FERNET_KEY = Fernet.generate_key().decode()


_MIGRATED: list[Path] = []


def _migrated_database(env: dict[str, str]) -> Path:
    """A database ``airflow db migrate`` made, once per process: each deployment starts from a
    copy of it rather than migrating again (several seconds of CPU each)."""
    if _MIGRATED:
        return _MIGRATED[0]
    home = Path(tempfile.mkdtemp(prefix="deferline-airflow-"))
    atexit.register(shutil.rmtree, home, True)
    database = home / "airflow.db"
    migrate = {
        **env,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{database}",
    }
    done = subprocess.run(
        [AIRFLOW, "db", "migrate"], env=migrate, capture_output=True, timeout=300, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{(done.stdout + done.stderr).decode()}")
    _MIGRATED.append(database)
    return database


class AirflowDeployment:
    """Airflow's own processes over one SQLite database in ``home``."""

    def __init__(
        self,
        home: Path,
        *,
        extra_env: dict[str, str] | None = None,
        dags_from: Path = DAGS,
        before_start: Sequence[Sequence[str]] = (),
    ) -> None:
        """``dags_from`` is copied to ``home/dags``; ``before_start`` are ``airflow``
        commands run after the database migration, before Airflow's processes start."""
        self.home = home
        self.db_path = home / "airflow.db"
        dags = home / "dags"
        shutil.copytree(dags_from, dags, ignore=shutil.ignore_patterns("__pycache__"))
        self._before_start = before_start
        self.dags = dags
        self.line = airflow_line()
        env = {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.db_path}",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__FERNET_KEY": FERNET_KEY,
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
            "AIRFLOW__SCHEDULER__TRIGGER_TIMEOUT_CHECK_INTERVAL": "5",
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(dags), os.environ.get("PYTHONPATH", "")) if p
            ),
            # Airflow's executors start `airflow tasks run` from the PATH.
            "PATH": os.pathsep.join((str(Path(AIRFLOW).parent), os.environ.get("PATH", ""))),
        }
        if self.line >= 3:
            port = free_port()
            env |= {
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                "AIRFLOW__CORE__PARALLELISM": "4",
                "AIRFLOW__API__PORT": str(port),
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
                "AIRFLOW__API_AUTH__JWT_SECRET": Fernet.generate_key().decode(),
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                # A worker's calls to the API server, on a machine shared and loaded (5 s):
                # a timeout fails the task before it runs.
                "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "60",
            }
        else:
            env |= {"AIRFLOW__CORE__EXECUTOR": "SequentialExecutor"}
        self.env = {**os.environ, **env, **(extra_env or {})}
        self.env.pop("_AIRFLOW__AS_LIBRARY", None)
        self._procs: list[tuple[subprocess.Popen[bytes], object]] = []

    def run(self, *args: str, timeout: float = 300) -> str:
        """``airflow ARGS`` to completion; its output."""
        done = subprocess.run(
            [AIRFLOW, *args],
            env=self.env,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        out = (done.stdout + done.stderr).decode(errors="replace")
        if done.returncode != 0:
            raise RuntimeError(f"airflow {' '.join(args)} failed ({done.returncode}):\n{out}")
        return out

    def clear(self, dag_id: str, run_id: str, task_id: str) -> None:
        """Clear one task instance as Airflow's UI and API do (``clear_task_instances``)."""
        where = f"TI.dag_id == {dag_id!r}, TI.run_id == {run_id!r}, TI.task_id == {task_id!r}"
        script = (
            "from sqlalchemy import select\n"
            "from airflow.models.taskinstance import TaskInstance as TI, clear_task_instances\n"
            "from airflow.utils.session import create_session\n"
            "with create_session() as session:\n"
            f"    tis = session.scalars(select(TI).where({where})).all()\n"
            "    assert len(tis) == 1, tis\n"
            "    clear_task_instances(tis, session)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], env=self.env, capture_output=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"clearing {task_id} failed:\n{done.stderr.decode()}")

    def spawn(self, *args: str) -> subprocess.Popen[bytes]:
        """Start ``airflow ARGS`` in the background, its output to ``home/<name>.log``."""
        log = (self.home / f"{args[0]}.log").open("wb")
        proc = subprocess.Popen(
            [AIRFLOW, *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # stopped with what it starts (see close)
        )
        self._procs.append((proc, log))
        return proc

    def start(self) -> None:
        """Migrate the database and start Airflow's processes (no triggerer)."""
        if self.env["AIRFLOW__CORE__FERNET_KEY"] == FERNET_KEY:
            shutil.copyfile(_migrated_database(self.env), self.db_path)
        else:  # rows the migration writes are encrypted with the deployment's own key
            self.run("db", "migrate")
        for command in self._before_start:
            self.run(*command)
        self.spawn("scheduler")
        if self.line >= 3:
            self.spawn("dag-processor")
            self.spawn("api-server")

    def close(self) -> None:
        """Stop Airflow's processes with what they started (the scheduler's LocalExecutor
        workers and log server would outlive it)."""
        stop_group(*(proc for proc, _ in reversed(self._procs)), grace=20.0)
        for _, log in self._procs:
            log.close()  # type: ignore[attr-defined]

    def query(self, sql: str, *params: object) -> list[tuple[object, ...]]:
        """Run ``sql`` on Airflow's database and commit; its rows."""
        with contextlib.closing(sqlite3.connect(self.db_path, timeout=30)) as db:
            rows = list(db.execute(sql, params).fetchall())
            db.commit()
            return rows

    def snapshot(self, to: Path) -> None:
        """A consistent copy of Airflow's database as it is now (SQLite's backup)."""
        with (
            contextlib.closing(sqlite3.connect(self.db_path, timeout=30)) as source,
            contextlib.closing(sqlite3.connect(to)) as copy,
        ):
            source.backup(copy)

    def wait_for(self, sql: str, *params: object, within: float = 120) -> list[tuple[object, ...]]:
        """Poll ``sql`` until it returns a row (fail after ``within`` seconds)."""

        def rows() -> list[tuple[object, ...]]:
            try:
                return self.query(sql, *params)
            except sqlite3.OperationalError:  # a table not there yet
                return []

        return until_sync(rows, within=within, interval=0.5, what=f"a row from {sql!r}")

    def task_log(self, dag_id: str, task_id: str, *, run_id: str = "*") -> str:
        """Every log file Airflow wrote for ``task_id`` of ``dag_id`` (in ``run_id``, or in
        any run), concatenated."""
        logs = self.home / "logs" / f"dag_id={dag_id}"
        paths = sorted(logs.glob(f"run_id={run_id}/task_id={task_id}/**/*.log"))
        return "".join(p.read_text(errors="replace") for p in paths)

    def states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        rows = self.query(
            "SELECT task_id, state FROM task_instance WHERE dag_id = ? AND run_id = ?",
            dag_id,
            run_id,
        )
        return {str(task): None if state is None else str(state) for task, state in rows}


@contextlib.contextmanager
def airflow_deployment(home: Path, **kwargs: Any) -> Iterator[AirflowDeployment]:
    deployment = AirflowDeployment(home, **kwargs)
    try:
        deployment.start()
        yield deployment
    finally:
        deployment.close()
