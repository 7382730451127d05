"""Airflow's metadata database, through Airflow's own models: the bridge's only door to it.

Synchronous (SQLAlchemy, as Airflow is): the bridge calls it from worker threads, each with
its own session (Airflow's thread-local ``Session``). Claims,
the job row, rows refused at claim and clean-up go through Airflow's own model code (``Job``,
``Trigger.assign_unassigned``, ``Trigger.ids_for_triggerer``, ``Trigger.submit_failure``,
``Trigger.clean_unused``). A batch of events is one commit (:meth:`apply`): the common events
(a task instance resumed, failed by its trigger, or timed out as Airflow's scheduler's
``check_trigger_timeouts`` does) are one bulk ``UPDATE`` per kind, setting the columns
Airflow's own functions set; the rare ones go through those functions.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import inspect
import logging
import time
import traceback
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from deferline.engine import check_airflow_environment

from ._rendering import StartFromTriggerRendering, has_template
from ._rows import BridgeEvent, ClaimedRow, KwargsNotRendered, RowRef

__all__ = ["AirflowDatabase", "AppliedEvents"]

logger = logging.getLogger(__name__)

JOB_TYPE = "TriggererJob"
_TIMEOUT_REASON_2 = "Trigger/execution timeout"  # Airflow 2.10's scheduler writes this


@dataclass(frozen=True, slots=True)
class AppliedEvents:
    """What one batch did: events written through Airflow's code, and stale ones skipped."""

    succeeded: int
    failed: int
    timed_out: int
    stale: int
    rows: frozenset[RowRef]


class TriggerFailed(Exception):
    """A trigger failed where deferline ran it; the message is its traceback there."""


class AirflowDatabase:
    """Airflow's triggerer's share of the metadata database, for one bridge process.

    Airflow is imported (and its configuration read, its ORM set up, as in every Airflow
    process) when this object is built, once the installed versions are checked: an
    environment Airflow is known not to run in raises ``AirflowEnvironmentError``.
    """

    def __init__(self, *, queues: Collection[str] | None, team_name: str | None) -> None:
        check_airflow_environment()
        self._airflow = importlib.import_module("airflow")
        self._settings: Any = importlib.import_module("airflow.settings")
        if getattr(self._settings, "engine", None) is None:
            self._settings.initialize()
        self._conf: Any = importlib.import_module("airflow.configuration").conf
        self._job_cls: Any = importlib.import_module("airflow.jobs.job").Job
        trigger_module: Any = importlib.import_module("airflow.models.trigger")
        self._trigger: Any = trigger_module.Trigger
        self._ti: Any = importlib.import_module("airflow.models.taskinstance").TaskInstance
        self._state: Any = importlib.import_module("airflow.utils.state").TaskInstanceState
        self._events: Any = importlib.import_module("airflow.triggers.base")
        self._sa: Any = importlib.import_module("sqlalchemy")
        self.transient: type[Exception] = importlib.import_module("sqlalchemy.exc").OperationalError
        """The database failed for a moment (connection lost, locked): nothing was written."""
        reason = getattr(trigger_module, "TriggerFailureReason", None)
        self._timeout_reason: Any = reason.TRIGGER_TIMEOUT if reason else _TIMEOUT_REASON_2
        self._fail_repr: str = getattr(trigger_module, "TRIGGER_FAIL_REPR", "__fail__")
        self._airflow2 = self.version.startswith("2.")
        self._handle_event_submit: Any = getattr(trigger_module, "handle_event_submit", None)
        self._failure_reason: Any = reason.TRIGGER_FAILURE if reason else "Trigger failure"
        # How Airflow 3 reads a task instance's stored next_kwargs and writes them back.
        self._decode_kwargs: Any = getattr(trigger_module, "_decode_next_kwargs", None)
        self._serialize: Any = (
            None if self._airflow2 else importlib.import_module("airflow.sdk.serde").serialize
        )
        self._base_serialization: Any = (
            importlib.import_module("airflow.serialization.serialized_objects").BaseSerialization
            if self._airflow2
            else None
        )
        params = inspect.signature(self._trigger.assign_unassigned).parameters
        # Only what this Airflow knows: queues came in 3.2, teams in 3.3.
        self._queue_kw: dict[str, Any] = {}
        if "queues" in params:
            self._queue_kw["queues"] = set(queues) if queues else None
        elif queues:
            raise ValueError(f"Airflow {self.version} has no trigger queues (3.2+): drop --queues")
        if "team_name" in params:
            self._queue_kw["team_name"] = team_name
        elif team_name:
            raise ValueError(f"Airflow {self.version} has no teams (3.3+): drop --team")
        self._refuse_as_airflow_does(queues, team_name)
        ids_params = inspect.signature(self._trigger.ids_for_triggerer).parameters
        self._ids_by_triggerer_only = set(ids_params) <= {"triggerer_id", "session"}
        self.job_id: int | None = None
        self.hostname: str = ""
        self._rendering: StartFromTriggerRendering | None = None

    def _refuse_as_airflow_does(self, queues: Collection[str] | None, team: str | None) -> None:
        """What ``airflow triggerer`` refuses: Airflow's claim ignores a team filter without
        ``[core] multi_team`` (the bridge would claim every team's rows), and no row has a
        queue without ``[triggerer] queues_enabled``."""
        conf = self._conf
        if queues and not conf.getboolean("triggerer", "queues_enabled", fallback=False):
            raise ValueError("--queues needs Airflow's [triggerer] queues_enabled = True")
        if team is None:
            return
        if not conf.getboolean("core", "multi_team", fallback=False):
            raise ValueError("--team needs Airflow's [core] multi_team = True")
        team_model: Any = importlib.import_module("airflow.models.team").Team
        if team_model.get_name_if_exists(team) is None:
            raise ValueError(f"Airflow has no team {team!r}")

    @property
    def version(self) -> str:
        return str(self._airflow.__version__)

    @property
    def dialect(self) -> str:
        """The database's SQLAlchemy dialect: ``postgresql``, ``mysql``, ``sqlite``."""
        return str(self._settings.engine.dialect.name)

    @property
    def health_check_threshold(self) -> float:
        """``[triggerer] triggerer_health_check_threshold``: when a silent triggerer is dead."""
        return float(self._conf.getfloat("triggerer", "triggerer_health_check_threshold"))

    @property
    def heartrate(self) -> float:
        """``[triggerer] job_heartbeat_sec``: how often a triggerer heartbeats."""
        return float(self._conf.getfloat("triggerer", "job_heartbeat_sec"))

    @contextmanager
    def _session(self) -> Iterator[Any]:
        session = self._settings.Session()
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    @property
    def engine(self) -> Any:
        """Airflow's SQLAlchemy engine."""
        return self._settings.engine

    def session(self) -> Any:
        """A session of Airflow's, committed when the block ends (rolled back on an error)."""
        return self._session()

    def live(self, session: Any, refs: Sequence[RowRef]) -> set[RowRef]:
        """Which of ``refs`` are rows of the ``trigger`` table (the same id and moment)."""
        return self._live(session, refs)

    def decrypt_kwargs(self, encrypted: Any) -> dict[str, Any]:
        """A row's kwargs as ``Trigger.kwargs`` reads them (Airflow's Fernet key, its serde)."""
        return dict(self._trigger._decrypt_kwargs(encrypted))

    def task_log_path(self, row_id: int) -> str | None:
        """The log file of the task instance deferred on trigger row ``row_id``, relative to
        ``[logging] base_log_folder``, as Airflow's triggerer names it (its log filename
        template); None when no task instance waits on the row."""
        ti = self._ti
        helpers: Any = importlib.import_module("airflow.utils.helpers")
        with self._session() as session:
            task_instance = session.scalars(
                self._sa.select(ti).where(ti.trigger_id == row_id).limit(1)
            ).first()
            if task_instance is None:
                return None
            return str(helpers.log_filename_template_renderer()(ti=task_instance))

    @property
    def trigger_log_server_port(self) -> int:
        """``[logging] trigger_log_server_port`` (8794), where Airflow's log reader asks a
        triggerer for the log of a deferred task's trigger."""
        return int(self._conf.getint("logging", "trigger_log_server_port", fallback=8794))

    @property
    def base_log_folder(self) -> str:
        """``[logging] base_log_folder``."""
        return str(self._conf.get("logging", "base_log_folder"))

    def _utcnow(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    # The TriggererJob row --------------------------------------------------------------

    def start_job(self) -> int:
        """Insert this bridge's ``TriggererJob`` row (state running), as a triggerer does."""
        job = self._job_cls(job_type=JOB_TYPE)
        job.prepare_for_execution()
        self.job_id = int(job.id)
        self.hostname = str(job.hostname)
        return self.job_id

    def heartbeat(self) -> None:
        """Set the job row's ``latest_heartbeat`` to now."""
        job = self._job_cls
        with self._session() as session:
            session.execute(
                self._sa.update(job)
                .where(job.id == self.job_id)
                .values(latest_heartbeat=self._utcnow())
            )

    def end_job(self) -> None:
        """Mark the job row finished (``success``, ``end_date``), as a triggerer's exit does."""
        if self.job_id is None:
            return
        job = self._job_cls
        with self._session() as session:
            session.execute(
                self._sa.update(job)
                .where(job.id == self.job_id)
                .values(state="success", end_date=self._utcnow())
            )

    # Claiming ---------------------------------------------------------------------------

    def claim(self, capacity: int, per_loop: int) -> set[int]:
        """``Trigger.assign_unassigned`` then ``Trigger.ids_for_triggerer``: the rows now ours.

        ``per_loop`` stands in for ``[triggerer] max_trigger_to_select_per_loop`` (50 in
        Airflow), the most rows one claim takes per kind of trigger.

        Where ``ids_for_triggerer`` filters on nothing but the triggerer (2.10: ``triggerer_id
        = job``), its query is run as plain SQL and read as the driver's tuples: its ORM
        reading of 100,000 ids took half a second a loop on the database thread the
        write-back shares. Where it also filters on
        queues and teams (3.x), Airflow's own is called, with a session whose ``scalars``
        reads the driver's tuples (:class:`_DriverScalars`).
        """
        trigger = self._trigger
        trigger.max_trigger_to_select_per_loop = per_loop
        trigger.assign_unassigned(
            self.job_id, capacity, self.health_check_threshold, **self._queue_kw
        )
        if not self._ids_by_triggerer_only:
            with self._session() as session:  # Airflow's query, the driver's tuples
                ids = trigger.ids_for_triggerer(
                    self.job_id, **self._queue_kw, session=_DriverScalars(session)
                )
                return set(ids)
        table = trigger.__table__
        query = self._sa.select(table.c.id).where(table.c.triggerer_id == self.job_id)
        with self._session() as session:
            result = session.connection().execute(query)
            try:  # the driver's own tuples: no SQLAlchemy row per id
                return {row_id for (row_id,) in result.cursor.fetchall()}
            finally:
                result.close()

    def read_rows(self, ids: Collection[int]) -> tuple[list[ClaimedRow], list[RowRef]]:
        """The claimed rows ``ids`` with the task instance waiting on each; and the rows that
        no task instance waits on (asset watchers, callbacks), which the bridge hands back.

        Plain columns, not ORM objects (a claim of thousands of rows shares the database
        thread with the write-back); the kwargs read as ``Trigger.kwargs`` reads them
        (``Trigger._decrypt_kwargs``: Airflow's Fernet key, then its deserializer).
        """
        trigger, ti = self._trigger, self._ti
        queue = getattr(trigger, "queue", None)  # 3.2+
        rows: list[ClaimedRow] = []
        others: list[RowRef] = []
        with self._session() as session:
            found = session.execute(
                self._sa.select(
                    trigger.id,
                    trigger.created_date,
                    trigger.classpath,
                    trigger.encrypted_kwargs,
                    queue if queue is not None else self._sa.null(),
                    ti.dag_id,
                    ti.task_id,
                    ti.run_id,
                    ti.map_index,
                    ti.try_number,
                    ti.trigger_timeout,
                    ti.next_method,
                )
                .outerjoin(ti, ti.trigger_id == trigger.id)
                .where(trigger.id.in_(list(ids)))
            ).all()
        for row_id, created, classpath, encrypted, row_queue, dag_id, *task in found:
            ref = RowRef.of(row_id, created)
            if dag_id is None:  # no task instance waits on it
                others.append(ref)
                continue
            kwargs: dict[str, Any] | None
            try:
                kwargs, error = dict(trigger._decrypt_kwargs(encrypted)), None
            except Exception as exc:  # Airflow's key or serializer refused them
                kwargs, error = None, exc
            task_id, run_id, map_index, try_number, trigger_timeout, next_method = task
            rows.append(
                ClaimedRow(
                    ref=ref,
                    classpath=classpath,
                    kwargs=kwargs,
                    kwargs_error=error,
                    queue=row_queue,
                    dag_id=dag_id,
                    task_id=task_id,
                    run_id=run_id,
                    map_index=map_index,
                    try_number=try_number,
                    trigger_timeout=trigger_timeout,
                    next_method=next_method,
                )
            )
        return [self._rendered(row) for row in rows], others

    def _rendered(self, row: ClaimedRow) -> ClaimedRow:
        """``row`` with its kwargs rendered when its task starts from its trigger and they
        hold a template (Airflow 3), or failed saying why they could not be."""
        if row.kwargs is None or self._airflow2 or not has_template(row.kwargs):
            return row
        if self._rendering is None:
            self._rendering = StartFromTriggerRendering()
        task = {
            "dag_id": row.dag_id,
            "task_id": row.task_id,
            "run_id": row.run_id,
            "map_index": row.map_index,
        }
        try:
            with self._session() as session:
                kwargs = self._rendering.render(session, row.classpath, row.kwargs, task)
        except KwargsNotRendered as exc:
            return dataclasses.replace(row, kwargs=None, kwargs_error=exc)
        return dataclasses.replace(row, kwargs=kwargs)

    def release(self, refs: Sequence[RowRef]) -> None:
        """Hand rows back (``triggerer_id`` cleared) for another triggerer to claim."""
        trigger = self._trigger
        with self._session() as session:
            session.execute(
                self._sa.update(trigger)
                .where(
                    trigger.id.in_([r.row_id for r in refs]), trigger.triggerer_id == self.job_id
                )
                .values(triggerer_id=None)
            )

    def existing(self, ids: Collection[int]) -> set[int]:
        """Which of ``ids`` are still rows of the ``trigger`` table."""
        trigger = self._trigger
        with self._session() as session:
            return set(
                session.scalars(self._sa.select(trigger.id).where(trigger.id.in_(list(ids))))
            )

    def clean_unused(self) -> None:
        """``Trigger.clean_unused``: delete the rows no task instance, asset or callback needs."""
        with self._session() as session:
            self._trigger.clean_unused(session=session)

    # Writing back -----------------------------------------------------------------------

    def fail_rows(self, failures: Sequence[tuple[RowRef, BaseException]]) -> None:
        """``Trigger.submit_failure`` for rows whose trigger cannot run, in one transaction."""
        with self._session() as session:
            live = self._live(session, [ref for ref, _ in failures])
            for ref, exc in failures:
                if ref in live:
                    self._trigger.submit_failure(ref.row_id, exc=exc, session=session)

    def apply(self, events: Sequence[BridgeEvent]) -> AppliedEvents:
        """Write ``events`` back with Airflow's own semantics, all in one transaction.

        An event whose row is gone, or was made anew under the same id, is stale and skipped.
        Airflow's guard (the task instance still ``deferred`` on that trigger) decides the
        rest: whatever the first event of a row does moves every task instance waiting on it
        out of ``deferred``, so a later event of the same row in the batch is skipped as the
        no-op it would be, and an event applied again in a later batch changes nothing.

        The common events are one bulk ``UPDATE`` each per batch (on PostgreSQL ``UPDATE …
        FROM unnest(…)``, elsewhere an ``executemany``; the guard in its ``WHERE``), setting
        the columns Airflow's own functions set: a plain event resuming a task instance
        (``handle_event_submit``; 2.10: ``TriggerEvent.handle_submit``), with its
        ``next_kwargs`` made as that function makes them; a failed trigger
        (``Trigger.submit_failure``); a timed-out one (the scheduler's
        ``check_trigger_timeouts``). A row with assets or a callback takes
        ``Trigger.submit_event`` whole, a task instance whose ``next_kwargs`` cannot be made
        Airflow's per-task-instance function, and an event that ends the task from the
        trigger ``Trigger.submit_event`` after the batch. The integration tests apply the
        same events both ways on two copies of one database and compare the rows (SQLite and
        PostgreSQL).
        """
        first: dict[RowRef, BridgeEvent] = {}
        for event in events:
            first.setdefault(event.ref, event)
        on_their_own: list[BridgeEvent] = []
        fails: list[tuple[int, dict[str, Any]]] = []
        resumed: list[tuple[int, Any, Any]] = []
        clock = [time.perf_counter()]
        with self._session() as session:
            live = self._live(session, list(first))
            todo = [event for ref, event in first.items() if ref in live]
            fired = [e for e in todo if e.kind == "fired" and e.task_outcome is None]
            clock.append(time.perf_counter())
            whole = self._with_assets_or_callbacks(session, [e.ref.row_id for e in fired])
            plain = {e.ref.row_id: e.payload for e in fired if e.ref.row_id not in whole}
            done = self._resume_in_place(session, plain)
            waiting = self._waiting(session, [r for r in plain if r not in done])  # the rest
            clock.append(time.perf_counter())
            for event in todo:
                row_id = event.ref.row_id
                if event.kind == "failed":
                    fails.append((row_id, self._failed_kwargs(event)))
                elif event.kind == "timed_out":
                    fails.append((row_id, {"error": self._timeout_reason}))
                elif event.task_outcome is not None:
                    on_their_own.append(event)
                elif row_id in whole:
                    self._trigger.submit_event(row_id, self._airflow_event(event), session=session)
                else:
                    resumed += [(row_id, key, event.payload) for key in waiting.get(row_id, ())]
            clock.append(time.perf_counter())
            self._resume(session, resumed)
            self._fail_waiting(session, fails)
            clock.append(time.perf_counter())
        clock.append(time.perf_counter())
        # Airflow ends a task from its trigger partly in sessions of its own (the XComs; on
        # 2.10 set_state and the callback too), which commit and close the thread's session:
        # after the batch, one event at a time, exactly as its own triggerer calls it.
        for event in on_their_own:
            self._trigger.submit_event(event.ref.row_id, self._airflow_event(event))
        if logger.isEnabledFor(logging.DEBUG):
            steps = ("live", "resume", "prepare", "update", "commit")
            logger.debug(
                "events applied",
                extra={
                    "events": len(events),
                    "resumed_in_place": len(done),
                    "resumed_after_read": len(resumed),
                    **{
                        f"{step}_s": round(clock[i + 1] - clock[i], 4)
                        for i, step in enumerate(steps)
                    },
                },
            )
        kinds = [e.kind for e in todo]
        return AppliedEvents(
            succeeded=kinds.count("fired"),
            failed=kinds.count("failed"),
            timed_out=kinds.count("timed_out"),
            stale=len(events) - len(todo),
            rows=frozenset(e.ref for e in todo),
        )

    def _waiting(self, session: Any, row_ids: Sequence[int]) -> dict[int, list[Any]]:
        """The task instances deferred on each of ``row_ids`` (``submit_event``'s selection),
        as their primary key and stored ``next_kwargs``."""
        sa, table = self._sa, self._ti.__table__
        keys = list(table.primary_key.columns)
        waiting: dict[int, list[Any]] = {}
        if row_ids:
            stored_kwargs = table.c.next_kwargs
            if self._airflow2:  # as stored, not deserialized (see _next_kwargs)
                stored_kwargs = sa.type_coerce(stored_kwargs, sa.JSON).label("next_kwargs")
            found = session.execute(
                sa.select(table.c.trigger_id, stored_kwargs, *keys).where(
                    _among(sa, session, table.c.trigger_id, row_ids),
                    table.c.state == self._state.DEFERRED,
                )
            )
            for trigger_id, stored, *key in found:
                waiting.setdefault(trigger_id, []).append((tuple(key), stored))
        return waiting

    def _resume_in_place(self, session: Any, payloads: dict[int, Any]) -> set[int]:
        """On PostgreSQL, the task instances deferred on each row (Airflow's guard) resumed
        with the row's event in one ``UPDATE … FROM unnest(…)``, their ``next_kwargs`` made in
        the statement from the stored ones (no read of the rows first), for the stored forms
        whose result is known without Airflow's decoder (:data:`_IN_PLACE`). Returns the rows
        whose task instance it resumed (one per row: Airflow's ``Trigger.task_instance``). The
        other task instances stay ``deferred`` for the caller's read and :meth:`_resume`, as do
        those of an event whose payload cannot be serialized; elsewhere this does nothing."""
        dialect = session.get_bind().dialect
        if dialect.name != "postgresql" or not payloads:
            return set()
        params: list[dict[str, Any]] = []
        for row_id, payload in payloads.items():
            try:
                event = self._serialized_event(payload)
            except Exception:  # Airflow's own function fails the task instance, saying why
                continue
            params.append({"b_trigger_id": row_id, "b_event": event})
        if not params:
            return set()
        sa, table = self._sa, self._ti.__table__
        rows = _unnest(sa, dialect, [table.c.trigger_id, table.c.next_kwargs])
        merged, usual = _IN_PLACE[self._airflow2]
        stored = f"{table.name}.{table.c.next_kwargs.name}"
        values: dict[str, Any] = {
            "state": self._state.SCHEDULED,
            "trigger_id": None,
            "next_kwargs": sa.literal_column(merged.format(stored=stored, event="v.c1")),
        }
        if not self._airflow2:
            values["scheduled_dttm"] = self._utcnow()
        statement = (
            sa.update(table)
            .where(
                table.c.trigger_id == rows.c.c0,
                table.c.state == self._state.DEFERRED,
                sa.text(usual.format(stored=stored)),
            )
            .values(**values)
            .returning(rows.c.c0)
        )
        types = [table.c.trigger_id.type, sa.JSON()]
        arrays = _arrays(dialect, types, ["b_trigger_id", "b_event"], params)
        return {row_id for (row_id,) in session.execute(statement, arrays)}

    def _serialized_event(self, payload: Any) -> Any:
        """The payload as Airflow's function serializes it inside ``next_kwargs`` (3.x: serde;
        2.10: the column's ``BaseSerialization``), serialized as a value of that dict."""
        if self._serialize is None:
            return self._base_serialization.serialize({"event": payload})["__var"]["event"]
        return self._serialize({"event": payload})["event"]

    def _resume(self, session: Any, resumed: Sequence[tuple[int, Any, Any]]) -> None:
        """Airflow's handling of a plain event for each waiting task instance, in one
        ``UPDATE``; a task instance whose ``next_kwargs`` cannot be made takes Airflow's own
        function (which fails it, saying why)."""
        table = self._ti.__table__
        keys = [*table.primary_key.columns, table.c.trigger_id]
        params: list[dict[str, Any]] = []
        for row_id, (key, stored), payload in resumed:
            try:
                next_kwargs = self._next_kwargs(stored, payload)
            except Exception:
                task_instance = session.get(self._ti, key)
                event = self._events.TriggerEvent(payload)
                self._handle_submit(event, task_instance, session)
                continue
            bound = zip([c.name for c in keys], [*key, row_id], strict=True)
            params.append({**{f"b_{name}": v for name, v in bound}, "b_kwargs": next_kwargs})
        self._update_waiting(session, keys, {}, params, serialized=self._airflow2)

    def _next_kwargs(self, stored: Any, payload: Any) -> Any:
        """A task instance's ``next_kwargs`` with the event in, as Airflow's function makes
        them (3.x: decoded, the event added, serialized with serde; 2.10: as stored, plus
        the event)."""
        if self._serialize is None:  # Airflow 2.10: stored and returned serialized
            return self._next_kwargs_2(stored, payload)
        next_kwargs = self._decode_kwargs(stored or {})
        next_kwargs["event"] = payload
        return self._serialize(next_kwargs)

    def _next_kwargs_2(self, stored: Any, payload: Any) -> Any:
        """Airflow 2.10's ``{**next_kwargs, "event": payload}`` in the serialized form its
        ``ExtendedJSON`` column stores, from the stored serialized form: a dict is stored as
        ``{"__var": {key: serialized value}, "__type": "dict"}``, so the stored values are
        kept as they are and the event serialized and added (not every stored value
        deserialized and serialized again)."""
        serialization = self._base_serialization
        shape = isinstance(stored, dict) and stored.keys() == {"__var", "__type"}
        if stored is None or (shape and stored["__type"] == "dict"):
            values = stored["__var"] if stored else {}
            if isinstance(values, dict):
                return {
                    "__var": {**values, "event": serialization.serialize(payload)},
                    "__type": "dict",
                }
        next_kwargs = serialization.deserialize(stored)  # not the usual shape: the long way
        return serialization.serialize({**(next_kwargs or {}), "event": payload})

    def _fail_waiting(self, session: Any, fails: Sequence[tuple[int, dict[str, Any]]]) -> None:
        """The task instances deferred on each row rescheduled to fail with its
        ``next_kwargs`` (``Trigger.submit_failure``, the scheduler's trigger timeout)."""
        params = [{"b_trigger_id": row_id, "b_kwargs": kwargs} for row_id, kwargs in fails]
        keys = [self._ti.__table__.c.trigger_id]
        self._update_waiting(session, keys, {"next_method": self._fail_repr}, params)

    def _update_waiting(
        self,
        session: Any,
        keys: Sequence[Any],
        values: dict[str, Any],
        params: list[Any],
        *,
        serialized: bool = False,
    ) -> None:
        """The task instances still ``deferred`` (Airflow's guard) matched on ``keys`` (bound
        as ``b_<column>``), each given its ``b_kwargs`` as ``next_kwargs``, moved off their
        trigger to ``scheduled`` (on 3.x, ``scheduled_dttm`` now) with ``values``.

        On PostgreSQL one ``UPDATE … FROM unnest(…)`` per batch, the values bound as one array
        per column (:func:`_unnest`); elsewhere (SQLite, MySQL) one ``executemany``
        ``UPDATE``. The integration tests compare both with Airflow's own
        writes, on SQLite and on PostgreSQL. ``serialized``: the ``b_kwargs`` are already in
        the column's stored form (Airflow 2.10's ``ExtendedJSON``), bound as plain JSON.
        """
        if not params:
            return
        sa, table = self._sa, self._ti.__table__
        kwargs_type = sa.JSON() if serialized else table.c.next_kwargs.type
        if not self._airflow2:
            values = {**values, "scheduled_dttm": self._utcnow()}
        values = {"state": self._state.SCHEDULED, "trigger_id": None, **values}
        dialect = session.get_bind().dialect
        if dialect.name != "postgresql":
            statement = (
                sa.update(table)
                .where(
                    *(c == sa.bindparam(f"b_{c.name}") for c in keys),
                    table.c.state == self._state.DEFERRED,
                )
                .values(
                    next_kwargs=sa.bindparam("b_kwargs", type_=kwargs_type),
                    **values,
                )
            )
            session.execute(statement, params)
            return
        columns = [*keys, table.c.next_kwargs]
        names = [f"b_{c.name}" for c in keys] + ["b_kwargs"]
        rows = _unnest(sa, dialect, columns)
        statement = (
            sa.update(table)
            .where(
                *(c == rows.c[f"c{i}"] for i, c in enumerate(keys)),
                table.c.state == self._state.DEFERRED,
            )
            .values(next_kwargs=rows.c[f"c{len(keys)}"], **values)
        )
        types = [c.type for c in keys] + [kwargs_type]
        session.execute(statement, _arrays(dialect, types, names, params))

    def _with_assets_or_callbacks(self, session: Any, row_ids: Sequence[int]) -> set[int]:
        trigger = self._trigger
        if not row_ids or not hasattr(trigger, "asset_watchers"):  # 2.10: neither exists
            return set()
        return set(
            session.scalars(
                self._sa.select(trigger.id).where(
                    trigger.id.in_(row_ids),
                    self._sa.or_(trigger.assets.any(), trigger.callback.has()),
                )
            )
        )

    def _handle_submit(self, event: Any, task_instance: Any, session: Any) -> None:
        """Airflow's own handling of one event for one waiting task instance."""
        if self._handle_event_submit is None:  # Airflow 2.10
            # In this session: 2.10's own call opens one of its own, which is this same
            # thread-local session, and closes it, detaching the batch's other rows.
            event.handle_submit(task_instance=task_instance, session=session)
        else:
            self._handle_event_submit(event, task_instance=task_instance, session=session)

    def _live(self, session: Any, refs: Sequence[RowRef]) -> set[RowRef]:
        """Which of ``refs`` are rows of the ``trigger`` table (the same id, made at the same
        moment)."""
        sa, table = self._sa, self._trigger.__table__
        # created_date as the driver hands it: RowRef.of takes an aware or a naive UTC time.
        created = sa.type_coerce(table.c.created_date, sa.DateTime(timezone=True))
        found = session.execute(
            sa.select(table.c.id, created).where(
                _among(sa, session, table.c.id, {r.row_id for r in refs})
            )
        ).all()
        return {RowRef.of(row_id, created) for row_id, created in found}

    def _airflow_event(self, event: BridgeEvent) -> Any:
        events = self._events
        if event.task_outcome is None:
            return events.TriggerEvent(event.payload)
        end = {
            "success": events.TaskSuccessEvent,
            "failed": events.TaskFailedEvent,
            "skipped": events.TaskSkippedEvent,
        }[event.task_outcome]
        return end(xcoms=event.xcoms)

    def _failed_kwargs(self, event: BridgeEvent) -> dict[str, Any]:
        """The ``next_kwargs`` ``Trigger.submit_failure`` writes for a failed event."""
        exc = self._failure(event)
        if isinstance(exc, BaseException):
            exc = traceback.format_exception(type(exc), exc, exc.__traceback__)
        return {"error": self._failure_reason, "traceback": exc}

    def _failure(self, event: BridgeEvent) -> Any:
        """What Airflow's triggerer hands ``submit_failure``: the runner's traceback lines on
        3.x, an exception on 2.10 (which formats it)."""
        lines = event.traceback or []
        if self._airflow2:
            return TriggerFailed("".join(lines).rstrip("\n"))
        return lines


_IN_PLACE_2 = (
    # Airflow 2.10's {**next_kwargs, "event": payload} in the serialized form its ExtendedJSON
    # column (json) stores, {"__var": {key: serialized value}, "__type": "dict"}: the stored
    # entries kept in their order, the event added last.
    """CASE WHEN {stored} IS NULL OR json_typeof({stored}) = 'null'
    THEN json_build_object('__var', json_build_object('event', {event}), '__type', 'dict')
    ELSE json_build_object('__var', (
        SELECT json_object_agg(key, value ORDER BY n) FROM (
            SELECT key, value, n
            FROM json_each({stored} -> '__var') WITH ORDINALITY AS s(key, value, n)
            UNION ALL SELECT 'event', {event}, 9223372036854775807
        ) AS entries
    ), '__type', 'dict') END""",
    # Taken in place: nothing stored, or a dict in that form without an "event" (Python
    # keeps a replaced key where it was).
    """({stored} IS NULL OR CASE json_typeof({stored})
        WHEN 'null' THEN true
        WHEN 'object' THEN ({stored} ->> '__type') = 'dict'
            AND json_typeof({stored} -> '__var') = 'object'
            AND (SELECT count(*) FROM json_object_keys({stored})) = 2
            AND ({stored} -> '__var' -> 'event') IS NULL
        ELSE false END)""",
)
_IN_PLACE_3 = (
    # Airflow 3's serialize({**_decode_next_kwargs(stored), "event": payload}) in the jsonb
    # column, where decoding and serializing again give back what is stored.
    """CASE WHEN {stored} IS NULL OR jsonb_typeof({stored}) = 'null'
    THEN jsonb_build_object('event', {event})
    ELSE {stored} || jsonb_build_object('event', {event}) END""",
    # Taken in place: nothing stored, or a dict of plain values (serde reads and writes each
    # as it is) without serde's or BaseSerialization's reserved keys.
    """({stored} IS NULL OR CASE jsonb_typeof({stored})
        WHEN 'null' THEN true
        WHEN 'object' THEN NOT EXISTS (
            SELECT FROM jsonb_each({stored}) AS s(key, value)
            WHERE left(key, 2) = '__' OR jsonb_typeof(value) IN ('object', 'array')
        )
        ELSE false END)""",
)
_IN_PLACE = {True: _IN_PLACE_2, False: _IN_PLACE_3}
"""By Airflow line (2.10: True): the SQL of a task instance's new ``next_kwargs`` from its
``{stored}`` ones and the serialized ``{event}``, and the condition on ``{stored}`` under which
that is what Airflow's own function makes."""


class _DriverScalars:
    """A session for Airflow's ``Trigger.ids_for_triggerer``: ``scalars(statement).all()``
    runs the statement on the session's connection and reads the driver's tuples (no
    SQLAlchemy row per id); anything else is the session's own."""

    def __init__(self, session: Any) -> None:
        self._session = session

    def scalars(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self._session.scalars(statement, *args, **kwargs)
        return _DriverRows(self._session, statement)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


@dataclass(frozen=True, slots=True)
class _DriverRows:
    session: Any
    statement: Any

    def all(self) -> list[Any]:
        result = self.session.connection().execute(self.statement)
        try:
            return [value for (value,) in result.cursor.fetchall()]
        finally:
            result.close()


def _among(sa: Any, session: Any, column: Any, values: Collection[Any]) -> Any:
    """``column`` is one of ``values``: on PostgreSQL ``= ANY(:array)``, one bound array (an
    ``IN`` of thousands of values is a bound parameter each, expanded for every statement);
    elsewhere ``IN``."""
    if session.get_bind().dialect.name != "postgresql":
        return column.in_(list(values))
    array = importlib.import_module("sqlalchemy.dialects.postgresql").ARRAY(column.type)
    return column == sa.any_(sa.bindparam(None, list(values), type_=array))


def _unnest(sa: Any, dialect: Any, columns: Sequence[Any]) -> Any:
    """``(SELECT … FROM unnest(:a0, :a1, …)) AS v``: one row per task instance, from one array
    per column (bound as ``a<i>``, each a list of the values as the driver takes them), the
    columns ``c0``, ``c1``… cast to their table column's type. The statement is the same for
    every batch, so SQLAlchemy compiles it once; the arrays go as bound values."""
    types = [c.type.compile(dialect=dialect) for c in columns]
    arrays = ", ".join(f"CAST(:a{i} AS TEXT[])" for i in range(len(columns)))
    named = ", ".join(f"CAST(c{i} AS {t}) AS c{i}" for i, t in enumerate(types))
    aliases = ", ".join(f"c{i}" for i in range(len(columns)))
    text = sa.text(f"SELECT {named} FROM unnest({arrays}) AS u({aliases})")
    return text.columns(*(sa.column(f"c{i}") for i in range(len(columns)))).subquery("v")


def _arrays(
    dialect: Any, types: Sequence[Any], names: Sequence[str], params: Sequence[Any]
) -> dict[str, list[str | None]]:
    """The bound arrays of :func:`_unnest`: each value made as ``types`` (its column's type,
    or plain JSON for ``next_kwargs`` already serialized) binds it, as text."""
    arrays: dict[str, list[str | None]] = {}
    for i, (type_, name) in enumerate(zip(types, names, strict=True)):
        bind = type_.dialect_impl(dialect).bind_processor(dialect)
        values = (item[name] for item in params)
        if bind is not None:
            values = (bind(value) for value in values)
        arrays[f"a{i}"] = [None if value is None else str(value) for value in values]
    return arrays
