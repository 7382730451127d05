"""Airflow on PostgreSQL (Debian's package, started here), so row locks are real.

The PostgreSQL server runs for the module in a temporary directory (``_postgres``); each test
gets its own database, a copy of one migrated Airflow schema. The deferrals are seeded as a
deferral leaves them (``_airflow_seed``); Airflow's own ``airflow triggerer`` resumes them
(the check that the seeded rows are the real thing), and two ``deferline airflow bridge``
processes do, one SIGKILLed while they fall due.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from deferline.schemas import TriggerEventRecord, decode_as
from deferline.topics import Settings, TopicNames

from tests._until import until, until_sync
from tests.airflow_line import STANDARD_TRIGGERS, airflow_line
from tests.conftest import in_ci
from tests.integration import _airflow_seed as seeding
from tests.integration._postgres import PostgresServer, postgres_bin
from tests.integration._process import DeferlineProcess
from tests.integration._util import KafkaClients

pytestmark = [pytest.mark.integration, pytest.mark.airflow]

AIRFLOW = Path(sys.executable).with_name("airflow")
ROOT = Path(__file__).parents[2]


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
    query = "SELECT count(*) FROM task_instance WHERE state = 'deferred'"
    left = -1

    def none_deferred() -> bool:
        nonlocal left
        left = int(postgres.psql(query, database))
        assert left == 0 or all(proc.poll() is None for proc in procs), "a triggerer exited"
        return left == 0

    until_sync(
        none_deferred,
        within=limit,
        interval=0.2,
        what=lambda: f"no task instance deferred ({left} still are)",
    )


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
        "SELECT state, trigger_id IS NULL, next_kwargs::text LIKE '%event%', try_number "
        "FROM task_instance",
    )
    assert sorted(map(tuple, resumed)) == [("scheduled", "t", "t", "1")] * n


# Stored next_kwargs other than the seeded ones, by map index (each gets a fired event): none,
# entries in no sorted order (kept in their order), a nested serialized value, an "event"
# already there, and forms the in-place UPDATE leaves to Airflow's decoder. By line (3.x: True).
STORED_NEXT_KWARGS = {
    False: {
        0: "NULL",
        3: """'{"__var": {"zeta": 1, "alpha": "a"}, "__type": "dict"}'""",
        5: """'{"__var": {"b": 2, "event": "old", "a": 1}, "__type": "dict"}'""",
        6: """'{"__var": {"a": 1}, "__type": "dict", "more": 1}'""",
        8: """'{"__var": {"at": {"__var": 1764072000.0, "__type": "datetime"}},"""
        """ "__type": "dict"}'""",
    },
    True: {
        0: "NULL",
        3: """'{"zeta": 1, "alpha": "a", "none": null}'""",
        5: """'{"b": 2, "event": "old"}'""",
        6: """'{"__var": {"a": 1}, "__type": "dict"}'""",
        8: """'{"opts": {"a": [1, 2]}}'""",
    },
}


@pytest.mark.timeout(600)
def test_the_bridge_writes_back_what_airflow_writes_on_postgres(
    postgres: PostgresServer, airflow_home: Path
) -> None:
    """The bridge's write-back on PostgreSQL (one ``UPDATE … FROM unnest(…)`` per kind and
    batch) writes the rows Airflow's own ``submit_event`` / ``submit_failure`` write, called
    once per event: the same events applied to two copies of one database of seeded
    deferrals, each way, every ``task_instance`` column compared (as the deployment test
    does on SQLite)."""
    env = seeding.airflow_env(airflow_home, postgres.create_database("same_rows", "migrated"))
    seeding.seed(env, 12, dt.datetime.now(dt.UTC) + dt.timedelta(days=1))
    for map_index, stored in STORED_NEXT_KWARGS[airflow_line() >= 3].items():
        postgres.psql(
            f"UPDATE task_instance SET next_kwargs = {stored} WHERE map_index = {map_index}",
            "same_rows",
        )
    out: dict[str, dict[str, list[dict[str, str]]]] = {}
    for way in ("airflow", "bridge"):
        url = postgres.create_database(f"same_rows_{way}", "same_rows")
        done = subprocess.run(
            [sys.executable, "-m", "tests.integration._bridge_equivalence", way, "seeded"],
            env={**env, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": url},
            cwd=ROOT,
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr.decode()
        out[way] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    differ = [
        (mine["map_index"], column, mine[column], theirs[column])
        for mine, theirs in zip(
            out["bridge"]["task_instance"], out["airflow"]["task_instance"], strict=True
        )
        for column in mine
        if mine[column] != theirs.get(column)
    ]
    assert not differ, differ
    assert out["bridge"] == out["airflow"]
    states = [(row["map_index"], row["state"]) for row in out["bridge"]["task_instance"]]
    assert states == [(str(i), "deferred" if i >= 9 else "scheduled") for i in range(12)]
    failed = {
        row["map_index"]
        for row in out["bridge"]["task_instance"]
        if "__fail__" in row["next_method"]
    }
    assert failed == {"1", "4", "7"}
    second = next(r for r in out["bridge"]["task_instance"] if r["map_index"] == "2")
    assert "second" not in second["next_kwargs"]


HA_N = 2000
HA_FIRST_CAPACITY = 1200
# Airflow's health threshold (a triggerer whose heartbeat is older is dead and its rows go to
# another) and heartbeat, shortened from 30 s and 5 s so the test waits less.
HEALTH_THRESHOLD_S = 10
HEARTBEAT_S = 1
POLL_S = 0.5
SETUP_S = 90
RECLAIM_LOOP_S = 5
# Every LATE_EVERY-th trigger row (by id) falls due a day later: still waiting at the kill,
# no event resumes it, so only a reclaim moves it off the killed bridge.
LATE_EVERY = 100
LATE_N = HA_N // LATE_EVERY


@pytest.fixture(scope="module")
def seeded_ha(postgres: PostgresServer, airflow_home: Path) -> str:
    """A database of HA_N deferrals due in a day (re-timed by each test's copy)."""
    env = seeding.airflow_env(airflow_home, postgres.create_database("seeded_ha", "migrated"))
    seeding.seed(env, HA_N, dt.datetime.now(dt.UTC) + dt.timedelta(days=1))
    return "seeded_ha"


def _count(postgres: PostgresServer, database: str, sql: str) -> int:
    return int(postgres.psql(sql, database))


@pytest.mark.timeout(900)
async def test_two_bridges_one_killed_while_due_resume_each_task_once(
    postgres: PostgresServer,
    airflow_home: Path,
    seeded_ha: str,
    settings: Settings,
    kafka_clients: KafkaClients,
    tmp_path: Path,
) -> None:
    database = f"ha_{settings.topic_prefix.strip('.')}"
    env = {
        **seeding.airflow_env(airflow_home, postgres.create_database(database, seeded_ha)),
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(HEALTH_THRESHOLD_S),
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": str(HEARTBEAT_S),
        "DEFERLINE_ALLOWED_TRIGGER_PREFIXES": STANDARD_TRIGGERS,
    }
    count = partial(_count, postgres, database)
    jobs = "SELECT count(*) FROM job WHERE job_type = 'TriggererJob'"
    held = "SELECT count(*) FROM trigger WHERE triggerer_id = {}"
    waiting_on = (
        "SELECT count(*) FROM task_instance ti JOIN trigger t ON t.id = ti.trigger_id "
        "WHERE ti.state = 'deferred' AND t.triggerer_id = {}"
    )
    late = f" AND t.id % {LATE_EVERY} = 0"
    deferred = "SELECT count(*) FROM task_instance WHERE state = 'deferred'"

    def bridge(name: str, *flags: str) -> DeferlineProcess:
        return DeferlineProcess(
            settings,
            ("airflow", "bridge"),
            tmp_path / f"{name}.log",
            "--bridge-prefix",
            settings.topic_prefix,
            "--poll-interval",
            str(POLL_S),
            "--claim-per-loop",
            "1000",
            "--log-format",
            "json",
            *flags,
            env=env,
        )

    # Due after the bridges have started and claimed every row (what they publish is read
    # from the rows when claimed, so the moment is set before).
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=SETUP_S)
    seeding.retime(env, due)
    seeding.retime(env, due + dt.timedelta(days=1), every=LATE_EVERY)
    triggerer = DeferlineProcess(
        settings,
        "triggerer",
        tmp_path / "triggerer.log",
        "--state-dir",
        str(tmp_path / "triggerer-state"),
        "--log-format",
        "json",
        env=env,
    )
    # Small write-back batches: the first bridge is killed while it still writes its share
    # back (in one batch of up to 5,000, a fast machine resumed it all before the kill).
    first = bridge("first", "--capacity", str(HA_FIRST_CAPACITY), "--max-events", "20")
    processes = [triggerer, first]
    try:
        # The first bridge claims up to its capacity, the second the rest: both hold rows.
        await until(
            lambda: count(jobs) == 1, within=120, interval=0.1, what="the first bridge's job row"
        )
        first_job = int(postgres.psql("SELECT max(id) FROM job", database))
        await until(
            lambda: count(held.format(first_job)) == HA_FIRST_CAPACITY,
            within=120,
            interval=0.1,
            what="the first bridge holds its capacity",
        )
        second = bridge("second")
        processes.append(second)
        await until(
            lambda: count("SELECT count(*) FROM trigger WHERE triggerer_id IS NULL") == 0,
            within=120,
            interval=0.1,
            what="the second bridge holds the rest",
        )
        assert time.time() < due.timestamp() - 5, f"claiming took over {SETUP_S - 5} s"
        await asyncio.sleep(due.timestamp() - time.time())
        await until(
            lambda: count(deferred) < HA_N,
            within=60,
            interval=0.1,
            what="the first task instance resumed",
        )
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        last_heartbeat = float(
            postgres.psql(
                f"SELECT extract(epoch FROM latest_heartbeat) FROM job WHERE id = {first_job}",
                database,
            )
        )
        still_waiting = count(waiting_on.format(first_job))
        late_held = count(waiting_on.format(first_job) + late)
        assert still_waiting > late_held, "the first bridge's tasks all resumed before the kill"
        assert late_held > 0, "the first bridge holds no row due later"
        # The rows that fired reach the survivor two ways: by Airflow's reclaim, and by
        # the bridges' consumer group (the survivor takes over the killed bridge's resume
        # partitions and writes their events back), which can win. The late rows have no
        # event, so only a reclaim moves them.
        try:
            await until(
                lambda: count(held.format(first_job)) == 0,
                within=HEALTH_THRESHOLD_S + 60,
                interval=0.1,
                what="the killed bridge's rows reclaimed",
            )
            reclaimed_s = time.time() - last_heartbeat
        except AssertionError as exc:
            holders = "SELECT triggerer_id, count(*) FROM trigger GROUP BY 1 ORDER BY 1"
            jobs_now = "SELECT id, now() - latest_heartbeat, end_date FROM job ORDER BY 1"
            detail = f"rows by holder {rows(postgres, database, holders)}, jobs (id, since "
            detail += f"heartbeat, end) {rows(postgres, database, jobs_now)}"
            raise AssertionError(f"{exc}: {detail}") from None
        await until(
            lambda: count(deferred) == LATE_N,
            within=180,
            interval=0.1,
            what="no task instance deferred but the late ones",
        )
        second_job = int(postgres.psql("SELECT max(id) FROM job", database))
        assert count(waiting_on.format(second_job) + late) == LATE_N
        assert second.alive
        assert triggerer.alive
    finally:
        for process in processes:
            process.close()
    # Reclaimed once the killed bridge's last heartbeat was older than the threshold, by the
    # next claim loop of the other (which shares its database thread with writing events back).
    assert HEALTH_THRESHOLD_S <= reclaimed_s <= HEALTH_THRESHOLD_S + RECLAIM_LOOP_S, (
        still_waiting,
        late_held,
        reclaimed_s,
    )
    # Airflow's rows: each task instance due resumed once, with its event, on its first try;
    # the late ones still wait on their trigger.
    resumed = rows(
        postgres,
        database,
        "SELECT state, trigger_id IS NULL, next_kwargs::text LIKE '%event%', try_number "
        "FROM task_instance",
    )
    assert sorted(map(tuple, resumed)) == [("deferred", "f", "f", "1")] * LATE_N + [
        ("scheduled", "t", "t", "1")
    ] * (HA_N - LATE_N)
    # The events: every trigger due fired, each event id once on the resume topic.
    consumer = await kafka_clients.consumer(
        TopicNames(settings.topic_prefix).resume(), auto_offset_reset="earliest"
    )
    events: list[TriggerEventRecord] = []
    while batch := await consumer.getmany(timeout_ms=2000):
        events += [
            decode_as(record.value, TriggerEventRecord)
            for records in batch.values()
            for record in records
        ]
    fired = [event for event in events if event.status == "fired"]
    assert len({event.trigger_id for event in fired}) == HA_N - LATE_N
    assert len({event.event_id for event in fired}) == HA_N - LATE_N
    # A bridge that holds a row whose event the other bridge wrote back (the resume partitions
    # are shared out apart from the rows) cancels it once Airflow deletes the row: the
    # triggerer answers with a cancelled event for a trigger that fired already, which changes
    # nothing (its task moved on: Airflow's rows above). Nothing else but fired events.
    others = [event for event in events if event.status != "fired"]
    assert {event.status for event in others} <= {"cancelled"}
    assert {event.trigger_id for event in others} <= {event.trigger_id for event in fired}
