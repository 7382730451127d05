"""Apply one set of events to an Airflow database, Airflow's way or the bridge's; print the rows.

``python -m tests.integration._bridge_equivalence airflow|bridge [seeded]`` in the environment
of an Airflow deployment (``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN`` names the copy to write). Run
once each way on two copies of one database, the printed rows must be equal: the bridge's
batched write-back (:meth:`AirflowDatabase.apply`) writes what Airflow's own
``Trigger.submit_event`` / ``submit_failure``, called once per event, write. The events are
those of the bad-input DAG of the deployment test (SQLite), or with ``seeded`` those of the
mapped task ``_airflow_seed`` defers (PostgreSQL).
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from typing import Any

from deferline.runners.airflow_bridge.testing import AirflowDatabase, BridgeEvent, RowRef

from tests.integration import _airflow_seed as seeding

DAG = "bridge_bad_input"
# Columns whose values are the clock at the write (differing between two runs: only whether
# each is set is compared).
CLOCK = {"scheduled_dttm", "updated_at", "end_date", "duration", "start_date", "timestamp"}
TRACEBACK = ["Traceback (most recent call last):\n", "RuntimeError: it broke there\n"]


def events(db: AirflowDatabase) -> list[BridgeEvent]:
    """Each kind of event, a duplicate and a stale one, for the bad-input DAG's tasks."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.models.trigger import Trigger
    from sqlalchemy import select

    refs: dict[str, RowRef] = {}
    with db._session() as session:
        for task_id, row_id, created in session.execute(
            select(TI.task_id, Trigger.id, Trigger.created_date)
            .join(Trigger, Trigger.id == TI.trigger_id)
            .where(TI.dag_id == DAG)
        ):
            refs[task_id] = RowRef.of(row_id, created)
    moment = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.UTC)
    return [
        BridgeEvent(refs["class_not_allowed"], "fired", payload={"n": 1, "at": moment}),
        BridgeEvent(refs["kwargs_undecryptable"], "failed", traceback=TRACEBACK),
        BridgeEvent(
            refs["class_missing"], "fired", task_outcome="success", xcoms={"k": "v", "n": 2}
        ),
        BridgeEvent(refs["good_neighbour"], "fired", payload="first"),
        BridgeEvent(refs["good_neighbour"], "fired", payload="second"),  # a no-op
        BridgeEvent(RowRef(10_000, 0), "fired", payload="of a row long gone"),
    ]


def seeded_events(db: AirflowDatabase) -> list[BridgeEvent]:
    """Fired and failed events for the seeded mapped task instances (map index 0 to 9), a
    duplicate, a stale one and one of a row made anew under the same id."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.models.trigger import Trigger
    from sqlalchemy import select

    refs: dict[int, RowRef] = {}
    with db._session() as session:
        for map_index, row_id, created in session.execute(
            select(TI.map_index, Trigger.id, Trigger.created_date)
            .join(Trigger, Trigger.id == TI.trigger_id)
            .where(TI.dag_id == seeding.DAG_ID)
        ):
            refs[map_index] = RowRef.of(row_id, created)
    moment = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.UTC)
    batch = [
        BridgeEvent(refs[i], "fired", payload={"n": i, "at": moment + dt.timedelta(seconds=i)})
        for i in (0, 2, 3, 5, 6, 8)
    ]
    batch += [BridgeEvent(refs[i], "failed", traceback=TRACEBACK) for i in (1, 4, 7)]
    batch.append(BridgeEvent(refs[2], "fired", payload="second"))  # a no-op
    batch.append(BridgeEvent(refs[1], "fired", payload="after the failure"))  # a no-op
    batch.append(BridgeEvent(RowRef(10_000_000, 0), "fired", payload="of a row long gone"))
    anew = RowRef(refs[9].row_id, refs[9].created_micros + 1)
    batch.append(BridgeEvent(anew, "fired", payload="of another row with that id"))
    return batch


def airflow_way(db: AirflowDatabase, batch: list[BridgeEvent]) -> None:
    """Airflow's triggerer's way: ``submit_event`` / ``submit_failure`` once per event, for the
    rows it runs (it never hears of a trigger row it does not have: one gone, or made anew)."""
    from airflow.models.trigger import Trigger

    with db._session() as session:
        live = db._live(session, [event.ref for event in batch])
    for event in batch:
        if event.ref not in live:
            continue
        if event.kind == "failed":
            Trigger.submit_failure(event.ref.row_id, exc=db._failure(event))
        else:
            Trigger.submit_event(event.ref.row_id, db._airflow_event(event))


def rows(db: AirflowDatabase, dag: str) -> dict[str, Any]:
    from sqlalchemy import text

    out: dict[str, Any] = {}
    with db._session() as session:
        for table, key in (("task_instance", ("task_id", "map_index")), ("xcom", ("key",))):
            query = text(f"SELECT * FROM {table} WHERE dag_id = :d")
            found = session.execute(query, {"d": dag}).mappings()
            out[table] = sorted(
                ({c: _value(c, v) for c, v in row.items()} for row in found),
                key=lambda row: tuple(row[k].zfill(9) for k in key),
            )
    return out


def _value(column: str, value: Any) -> str:
    """A column's value; for a column of the clock, whether it is set."""
    if column in CLOCK:
        return "unset" if value is None else "set"
    if isinstance(value, memoryview | bytes):  # PostgreSQL's bytea
        return bytes(value).hex()
    return str(value)


def main(way: str, which: str = "bad_input") -> None:
    db = AirflowDatabase(queues=None, team_name=None)
    seeded = which == "seeded"
    batch = seeded_events(db) if seeded else events(db)
    if way == "airflow":
        airflow_way(db, batch)
    else:
        db.apply(batch)
    print(json.dumps(rows(db, seeding.DAG_ID if seeded else DAG)))


if __name__ == "__main__":
    main(*sys.argv[1:])
