"""Each trigger's own log lines in Airflow's UI, with the bridge and deferline triggerers.

A real Airflow 3.3 deployment (scheduler, DAG processor, API server, LocalExecutor, SQLite),
no ``airflow triggerer``. A task defers on a trigger that logs a line every 0.2 s (and a
password it masked first) until the test releases it. The bridge and the triggerer run with
``--trigger-logs``; the test reads the task's log through Airflow's REST API (what the UI
calls): while the task is deferred (served by the bridge's log server at its job's host),
after the bridge that served it was replaced (the next one claims the row and serves the
lines again), and after the task resumed. The deployment keeps its logs in a remote store (a
folder, through Airflow's ``REMOTE_TASK_LOG`` of a ``logging_config_class``): once the row is
gone, the bridge uploads the trigger's files there, and the UI reads them from it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from deferline.topics import Settings, free_port

from tests._until import until
from tests.airflow_line import airflow_version

from ._airflow_deployment import AirflowDeployment
from ._airflow_processes import Processes, reach, run_id_of, trigger_dag

pytestmark = [
    pytest.mark.integration,
    pytest.mark.airflow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(airflow_version() < (3, 0), reason="the log reader of Airflow 3 is tested"),
]

DAGS = Path(__file__).with_name("airflow_logs_dags")
SECRET = "hunter2-do-not-log"
HEALTH_THRESHOLD_S = 5


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("releases")


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("remote-logs")


@pytest.fixture(scope="module")
def airflow(
    tmp_path_factory: pytest.TempPathFactory, releases: Path, remote: Path
) -> Iterator[AirflowDeployment]:
    af = AirflowDeployment(
        tmp_path_factory.mktemp("airflow"),
        extra_env={
            "AIRFLOW__LOGGING__LOGGING_CONFIG_CLASS": "folder_remote_logs.LOGGING_CONFIG",
            "REMOTE_LOG_FOLDER": str(remote),
            "LOGS_RELEASE_DIR": str(releases),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(HEALTH_THRESHOLD_S),
            "DEFERLINE_ALLOWED_TRIGGER_PREFIXES": "log_triggers",
            "DEFERLINE_COPY_EVENTS_TO_TASKS": "false",
            "DEFERLINE_TRIGGER_LOGS": "true",
        },
        dags_from=DAGS,
    )
    try:
        af.start()
        af.wait_for("SELECT 1 FROM dag WHERE dag_id = 'logging_trigger'", within=180)
        yield af
    finally:
        af.close()


def task_log(af: AirflowDeployment, run_id: str) -> list[str]:
    """The task's log lines (their ``event``) as Airflow's REST API gives them to the UI."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{af.env['AIRFLOW__API__PORT']}/api/v2/dags/logging_trigger/"
        f"dagRuns/{run_id}/taskInstances/chatty/logs/1?full_content=true",
        headers={"Accept": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        content: Any = json.loads(reply.read())["content"]
    return [str(line.get("event", "")) if isinstance(line, dict) else str(line) for line in content]


async def lines_seen(af: AirflowDeployment, run_id: str, *wanted: str) -> list[str]:
    """Wait until the task's log holds a line containing each of ``wanted``; the lines."""
    seen: list[str] = []

    def check() -> bool:
        nonlocal seen
        seen = task_log(af, run_id)
        return all(any(w in line for line in seen) for w in wanted)

    await until(
        partial(asyncio.to_thread, check),
        within=120,
        interval=1.0,
        what=lambda: f"{wanted} in the task log (last lines: {seen[-8:]})",
    )
    return seen


async def test_a_deferred_tasks_trigger_lines_show_in_its_log_while_deferred_and_after(
    airflow: AirflowDeployment,
    processes: Processes,
    settings: Settings,
    releases: Path,
    remote: Path,
) -> None:
    af = airflow
    run_id = run_id_of(settings, "logs")
    first = processes.bridge("bridge-1")
    processes.triggerer("triggerer")
    await trigger_dag(af, "logging_trigger", run_id)
    await reach(af, "logging_trigger", run_id, {"chatty"}, "deferred")

    # Deferred: the lines come from the bridge's log server (Airflow asks the host of the
    # task's triggerer job), the password masked as Airflow masks it.
    seen = await lines_seen(af, run_id, "chatty chatty line 3", "starts with the password")
    assert not any(SECRET in line for line in seen)
    assert any("starts with the password ***" in line for line in seen)

    # The bridge replaced: the next one claims the row (Airflow's health threshold), writes
    # the lines again (from ten minutes back) into its own job's file, and serves them.
    first.proc.send_signal(signal.SIGKILL)
    processes.bridge("bridge-2")
    [(old_job,)] = af.query(
        "SELECT id FROM job WHERE job_type = 'TriggererJob' ORDER BY id LIMIT 1"
    )
    await until(
        partial(
            asyncio.to_thread,
            lambda: bool(
                af.query(
                    "SELECT 1 FROM trigger t JOIN task_instance ti ON ti.trigger_id = t.id "
                    "WHERE ti.run_id = ? AND t.triggerer_id != ?",
                    run_id,
                    old_job,
                )
            ),
        ),
        within=120,
        interval=0.5,
        what="the row claimed by the next bridge",
    )
    seen = await lines_seen(af, run_id, "chatty chatty line 1")
    later = max(int(line.rsplit(" ", 1)[1]) for line in seen if "chatty chatty line" in line)
    await lines_seen(af, run_id, f"chatty chatty line {later + 5}")

    # Released: the task resumes, and its log holds its own lines and the trigger's.
    (releases / run_id).touch()
    await reach(af, "logging_trigger", run_id, {"chatty"}, "success")
    seen = await lines_seen(af, run_id, "released after", "resumed after")
    assert not any(SECRET in line for line in seen)
    files = sorted(p.name for p in (af.home / "logs").rglob("attempt=1.log*") if run_id in str(p))
    assert len([f for f in files if ".trigger." in f]) == 2, files  # one per bridge job

    # The row gone (Airflow's clean_unused), the bridge holding it uploads its file; the
    # UI reads the finished task's log from the remote store, the local copies gone.
    def uploaded() -> list[Path]:
        return [p for p in remote.rglob("*.trigger.*.log") if run_id in str(p)]

    await until(lambda: uploaded(), within=120, interval=0.5, what="the trigger log uploaded")
    for local in (af.home / "logs").rglob("attempt=1.log.trigger.*.log"):
        if run_id in str(local):
            local.unlink()
    seen = await lines_seen(af, run_id, "released after", "resumed after")
    assert not any(SECRET in line for line in seen)
