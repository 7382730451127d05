"""``deferline airflow bridge`` in a real Airflow deployment: no ``airflow triggerer`` runs.

Airflow's own processes (scheduler, DAG processor and API server with the LocalExecutor on
Airflow 3; scheduler with the SequentialExecutor on 2.10), one SQLite database, a bridge and
one ``deferline triggerer`` on the bridge's prefix. Two DAG runs:

* ``bridge_test``: date-time and time-delta sensors, an HTTP sensor against a local aiohttp
  server, a trigger that fails, one that times out, one cleared while deferred (its trigger is
  cancelled in deferline and its ``on_kill`` runs). Each task ends as Airflow's own
  triggerer leaves it.
* ``bridge_bad_input``: deferred before the bridge starts; then one row's kwargs are made
  undecryptable. A class outside the allowed prefixes, the undecryptable kwargs and a missing
  class each fail their task with the reason in its log (from ``next_kwargs``); the good
  neighbour resumes.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import aiohttp
import pytest
from deferline.topics import Settings

from tests._until import until
from tests.airflow_line import STANDARD_TRIGGERS, airflow_line

from ._airflow_deployment import AirflowDeployment, airflow_deployment
from ._process import DeferlineProcess
from .test_airflow_triggers import http_api

pytestmark = [pytest.mark.integration, pytest.mark.airflow, pytest.mark.timeout(600)]

ROOT = Path(__file__).parents[2]
ALLOWED = f"{STANDARD_TRIGGERS},airflow.providers.http.triggers,bridge_triggers"
RUN = "bridge-run"
BAD_RUN = "bridge-bad-input"
EXPECTED = {
    "wait_datetime": "success",
    "wait_timedelta": "success",
    "wait_http": "success",
    "trigger_fails": "failed",
    "trigger_times_out": "failed",
    "cleared_while_deferred": "success",
}
BAD_EXPECTED = {
    "class_not_allowed": ("failed", "is not under an allowed prefix"),
    "kwargs_undecryptable": ("failed", "cannot be read with Airflow's key"),
    "class_missing": ("failed", "NoSuchTrigger"),
    "good_neighbour": ("success", None),
}


def deferred(af: AirflowDeployment, run_id: str, task_id: str) -> bool:
    return af.states(_dag(run_id), run_id).get(task_id) == "deferred"


def executor_reported(af: AirflowDeployment, task_id: str) -> bool:
    """The scheduler has read the executor's report of the run that deferred ``task_id``."""
    log = (af.home / "scheduler.log").read_text(errors="replace")
    return any(
        "Received executor event with state success" in line and f"'{task_id}'" in line
        for line in log.splitlines()
    )


def _dag(run_id: str) -> str:
    return "bridge_test" if run_id == RUN else "bridge_bad_input"


def claimed(af: AirflowDeployment, task_id: str) -> bool:
    rows = af.query(
        "SELECT t.triggerer_id FROM trigger t JOIN task_instance ti ON ti.trigger_id = t.id "
        "WHERE ti.run_id = ? AND ti.task_id = ? AND ti.state = 'deferred'",
        RUN,
        task_id,
    )
    return bool(rows) and rows[0][0] is not None


def finished(af: AirflowDeployment, run_id: str) -> bool:
    rows = af.query("SELECT state FROM dag_run WHERE run_id = ?", run_id)
    return bool(rows) and rows[0][0] in ("success", "failed")


async def metrics(port: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        text = await response.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def test_a_deployment_runs_its_deferred_tasks_through_the_bridge(
    settings: Settings, tmp_path: Path
) -> None:
    marker = tmp_path / "on_kill"
    async with http_api() as (api, api_state):
        env = {
            "AIRFLOW_CONN_BRIDGE_TEST_API": api,
            "BRIDGE_TEST_KILL_MARKER": str(marker),
            "DEFERLINE_ALLOWED_TRIGGER_PREFIXES": ALLOWED,
        }
        home = tmp_path / "airflow"
        home.mkdir()
        with airflow_deployment(home, extra_env=env) as af:
            await until(
                partial(
                    asyncio.to_thread,
                    lambda: (
                        len(af.query("SELECT dag_id FROM dag WHERE dag_id LIKE 'bridge_%'")) == 2
                    ),
                ),
                within=180,
                interval=0.5,
                what="Airflow knows both DAGs",
            )
            af.run("dags", "trigger", "bridge_bad_input", "--run-id", BAD_RUN)
            af.run("dags", "trigger", "bridge_test", "--run-id", RUN)
            for task_id in BAD_EXPECTED:
                await until(
                    partial(asyncio.to_thread, deferred, af, BAD_RUN, task_id),
                    within=180,
                    interval=0.5,
                    what=f"{task_id} deferred",
                )
                # Until Airflow's scheduler has read the executor's report of the run that
                # deferred, a resume written back makes it fail the task instance as changed
                # behind its back ("finished with state success, but ... queued"), not run it.
                await until(
                    partial(asyncio.to_thread, executor_reported, af, task_id),
                    within=180,
                    interval=0.5,
                    what=f"{task_id}'s deferring run reported",
                )
            snapshot = tmp_path / "deferred.db"
            af.snapshot(snapshot)
            # Undecryptable with Airflow's key: what a rotated-away Fernet key leaves behind.
            af.query(
                "UPDATE trigger SET kwargs = 'gAAAA-not-a-fernet-token' WHERE id = "
                "(SELECT trigger_id FROM task_instance WHERE run_id = ? AND task_id = ?)",
                BAD_RUN,
                "kwargs_undecryptable",
            )
            bridge = DeferlineProcess(
                settings,
                ("airflow", "bridge"),
                tmp_path / "bridge.log",
                "--bridge-prefix",
                settings.topic_prefix,
                "--metrics-port",
                "0",
                "--metrics-host",
                "127.0.0.1",
                "--poll-interval",
                "0.5",
                "--log-format",
                "json",
                env=af.env,
            )
            triggerer = DeferlineProcess(
                settings,
                "triggerer",
                tmp_path / "triggerer.log",
                "--member",
                "t1",
                "--state-dir",
                str(tmp_path / "t1"),
                "--log-format",
                "json",
                # As docs/airflow.md says: no deferline scheduler reads the bridge's prefix.
                env={**af.env, "DEFERLINE_COPY_EVENTS_TO_TASKS": "false"},
            )
            try:
                await _drive(af, api_state)
                await _check(af, marker, bridge, triggerer)
                same_rows_both_ways(af, snapshot, tmp_path)
            finally:
                triggerer.close()
                bridge.close()


async def _drive(
    af: AirflowDeployment,
    api_state: dict[str, bool],
) -> None:
    await until(
        partial(asyncio.to_thread, deferred, af, RUN, "wait_http"),
        within=180,
        interval=0.5,
        what="wait_http deferred",
    )
    await until(
        partial(asyncio.to_thread, executor_reported, af, "wait_http"),
        within=180,
        interval=0.5,
        what="the HTTP sensor's deferring run reported",
    )
    api_state["ready"] = True
    # Claimed by the bridge, so published: the triggerer reads its cancel after its request.
    await until(
        partial(asyncio.to_thread, claimed, af, "cleared_while_deferred"),
        within=180,
        interval=0.5,
        what="the cleared task's trigger is claimed",
    )
    af.clear("bridge_test", RUN, "cleared_while_deferred")
    for run_id in (RUN, BAD_RUN):
        await until(
            partial(asyncio.to_thread, finished, af, run_id),
            within=300,
            interval=0.5,
            what=f"{run_id} finished",
        )


async def _check(
    af: AirflowDeployment,
    marker: Path,
    bridge: DeferlineProcess,
    triggerer: DeferlineProcess,
) -> None:
    assert af.states("bridge_test", RUN) == EXPECTED
    bad = af.states("bridge_bad_input", BAD_RUN)
    assert bad == {task: state for task, (state, _) in BAD_EXPECTED.items()}
    for task_id, (_, reason) in BAD_EXPECTED.items():
        if reason is not None:
            log = af.task_log("bridge_bad_input", task_id)
            assert "Trigger failure" in log, task_id
            assert reason in log, f"{task_id}: {reason!r} not in its log"
    # The cleared task's trigger was cancelled in deferline, and its on_kill ran (3.3+).
    cancelled = [
        line
        for line in triggerer.find("trigger cancelled")
        if "cleared_while_deferred" in line.get("task", "")
    ]
    assert cancelled
    if airflow_line() >= 3:
        await until(
            partial(asyncio.to_thread, marker.exists), within=10, interval=0.5, what="on_kill ran"
        )
    # Airflow sees a healthy triggerer.
    af.run("jobs", "check", "--job-type", "TriggererJob")
    assert bridge.alive
    assert triggerer.alive
    # Airflow's triggerer metrics, with their meaning: every fired event written back, every
    # failed one and the two rows the bridge refused itself; nothing claimed any more. (How
    # many fired depends on the clock: a time-delta sensor run after its moment never defers.)
    produced = [line["status"] for line in triggerer.find("trigger event produced")]
    port = int(bridge.find("metrics served")[0]["port"])
    scraped = await metrics(port)
    assert scraped["airflow_triggers_succeeded_total"] == produced.count("fired")
    assert scraped["airflow_triggers_failed_total"] == produced.count("failed") + 2
    running = {k: v for k, v in scraped.items() if k.startswith("airflow_triggers_running{")}
    assert list(running.values()) == [0]
    assert "hostname=" in next(iter(running))


def same_rows_both_ways(af: AirflowDeployment, snapshot: Path, workdir: Path) -> None:
    """The bridge's batched write-back writes the rows Airflow's own functions write: the
    same events (each kind, a duplicate, a stale one) applied to two copies of one database
    of deferred task instances, once through ``Trigger.submit_event`` / ``submit_failure``
    per event, once through :meth:`AirflowDatabase.apply`."""
    out: dict[str, dict[str, list[dict[str, str]]]] = {}
    for way in ("airflow", "bridge"):
        copy = workdir / f"{way}_way.db"
        shutil.copy(snapshot, copy)
        env = {**af.env, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{copy}"}
        done = subprocess.run(
            [sys.executable, "-m", "tests.integration._bridge_equivalence", way],
            env=env,
            cwd=ROOT,
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr.decode()
        out[way] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert out["bridge"] == out["airflow"]
    states = {row["task_id"]: row["state"] for row in out["bridge"]["task_instance"]}
    assert states == {
        "class_not_allowed": "scheduled",
        "kwargs_undecryptable": "scheduled",
        "class_missing": "success",
        "good_neighbour": "scheduled",
    }
    neighbour = next(r for r in out["bridge"]["task_instance"] if r["task_id"] == "good_neighbour")
    assert "first" in neighbour["next_kwargs"]
    assert "second" not in neighbour["next_kwargs"]
    assert [row["key"] for row in out["bridge"]["xcom"]] == ["k", "n"]
