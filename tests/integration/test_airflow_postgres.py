"""Airflow on PostgreSQL (Debian's package, started here): deferrals seeded through Airflow's code.

The PostgreSQL server runs for the module in a temporary directory (``_postgres``); each test
gets its own database, a copy of one migrated Airflow schema. The deferrals are seeded as a
deferral leaves them (``_airflow_seed``), which Airflow's own ``airflow triggerer`` resumes:
the check that the seeded rows are the real thing.
"""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.airflow_line import STANDARD_TRIGGERS
from tests.conftest import in_ci
from tests.integration import _airflow_seed as seeding
from tests.integration._postgres import PostgresServer, postgres_bin

pytestmark = pytest.mark.airflow

AIRFLOW = Path(sys.executable).with_name("airflow")


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    bin_dir = postgres_bin()
    if bin_dir is None:
        reason = "PostgreSQL's server is not installed (apt-get install postgresql)"
        if in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    server = PostgresServer(bin_dir)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def airflow_home(postgres: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An Airflow home whose ``migrated`` database holds Airflow's schema."""
    home = tmp_path_factory.mktemp("airflow-home")
    seeding.migrate(seeding.airflow_env(home, postgres.create_database("migrated")))
    return home


def rows(postgres: PostgresServer, database: str, sql: str) -> list[list[str]]:
    out = postgres.psql(sql, database)
    return [line.split("|") for line in out.splitlines()] if out else []


def wait_none_deferred(
    postgres: PostgresServer, database: str, procs: list[subprocess.Popen[bytes]], limit: float
) -> None:
    deadline = time.monotonic() + limit
    query = "SELECT count(*) FROM task_instance WHERE state = 'deferred'"
    while (left := int(postgres.psql(query, database))) and time.monotonic() < deadline:
        assert all(proc.poll() is None for proc in procs), "a triggerer exited"
        time.sleep(0.2)
    assert left == 0, f"{left} task instances still deferred after {limit} s"


def test_airflow_triggerer_resumes_the_seeded_deferrals(
    postgres: PostgresServer, airflow_home: Path, tmp_path: Path
) -> None:
    n = 40
    env = seeding.airflow_env(airflow_home, postgres.create_database("peer", "migrated"))
    seeding.seed(env, n, dt.datetime.now(dt.UTC) + dt.timedelta(days=1))
    waiting = rows(
        postgres,
        "peer",
        "SELECT ti.state, ti.next_method, t.classpath FROM task_instance ti "
        "JOIN trigger t ON t.id = ti.trigger_id",
    )
    assert len(waiting) == n
    assert {tuple(row) for row in waiting} == {
        ("deferred", "execute_complete", f"{STANDARD_TRIGGERS}.temporal.DateTimeTrigger")
    }
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)
    seeding.retime(env, moment)
    with (tmp_path / "triggerer.log").open("wb") as log:
        triggerer = subprocess.Popen(
            [str(AIRFLOW), "triggerer"], env=env, stdout=log, stderr=log, start_new_session=True
        )
        try:
            wait_none_deferred(postgres, "peer", [triggerer], limit=120)
        finally:
            seeding.stop_group(triggerer)
    resumed = rows(
        postgres,
        "peer",
        "SELECT state, trigger_id IS NULL, next_kwargs::text LIKE '%event%' FROM task_instance",
    )
    assert sorted(map(tuple, resumed)) == [("scheduled", "t", "t")] * n
