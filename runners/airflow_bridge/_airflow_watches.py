"""Airflow's asset watchers and deadline-alert callbacks on deferline: their rows read for
publishing, their events applied exactly once.

An asset watcher is a trigger row no task instance waits on, linked to assets through
``asset_watcher`` (Airflow 3); a deadline-alert callback's row is linked to its ``callback``
row (3.1+) and runs Airflow's ``CallbackTrigger`` once. Airflow's triggerer hands every event
of either to ``Trigger.submit_event``, which registers an asset change per watched asset or
records the callback's state (``running``, then ``success`` or ``failed`` with its output),
with no guard against an event applied twice. Here each event carries its own id
(:func:`~deferline.schemas.make_watch_event_id`), and the id is recorded in the table
``deferline_watch_event`` in the same transaction as the asset events: an event read again
(after a bridge's crash, a rebalance, a replayed topic) finds its id there and changes
nothing. Ids are kept a little longer than the resume topic keeps events (7 days), past
which no event can be read again.
"""

from __future__ import annotations

import datetime as dt
import importlib
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ._airflow_db import AirflowDatabase
from ._rows import RowRef, WatchApply, WatchRow

__all__ = ["AirflowWatches", "AppliedWatchEvents"]

logger = logging.getLogger(__name__)

APPLIED_TABLE: Final = "deferline_watch_event"
KEEP_APPLIED: Final = dt.timedelta(days=8)
"""How long an applied event id is kept: the resume topic's retention (7 days) and a day."""
_ATTEMPTS: Final = 3


@dataclass(frozen=True, slots=True)
class AppliedWatchEvents:
    """What one batch of watch events did."""

    fired: int
    """Events applied: an asset event for each asset the watcher watches."""
    failed: int
    """Failed runs recorded (a watcher's changes nothing in Airflow; a callback's fails it)."""
    repeated: int
    """Events applied before (their id recorded): skipped."""
    stale: int
    """Events of rows Airflow no longer has: skipped."""


class AirflowWatches:
    """The asset watcher rows of one bridge's Airflow (3.x) and the ids of applied events."""

    def __init__(self, db: AirflowDatabase) -> None:
        self._db = db
        sa: Any = importlib.import_module("sqlalchemy")
        self._sa = sa
        self._trigger: Any = importlib.import_module("airflow.models.trigger").Trigger
        asset: Any = importlib.import_module("airflow.models.asset")
        self._asset, self._watcher = asset.AssetModel, asset.AssetWatcherModel
        self._event: Any = importlib.import_module("airflow.triggers.base").TriggerEvent
        self._has_callbacks = hasattr(self._trigger, "callback")  # 3.1+
        self._conflict: type[Exception] = importlib.import_module("sqlalchemy.exc").IntegrityError
        self._applied = sa.Table(
            APPLIED_TABLE,
            sa.MetaData(),
            sa.Column("event_id", sa.String(250), primary_key=True),
            sa.Column("trigger_id", sa.Integer, nullable=False),
            sa.Column("applied_at", sa.DateTime(timezone=True), nullable=False, index=True),
        )

    def create_table(self) -> None:
        """Create ``deferline_watch_event`` in Airflow's database unless it is there."""
        self._applied.create(bind=self._db.engine, checkfirst=True)

    def read(self, refs: Sequence[RowRef]) -> tuple[list[WatchRow], list[RowRef]]:
        """Of rows no task instance waits on, the asset watchers (with their assets) and the
        callbacks; and the rest (rows nothing needs any more, whose callback ended), which
        the bridge hands back for ``clean_unused``."""
        watches = self._asset_watchers(refs)
        seen = {w.ref.row_id for w in watches}
        watches += self._callbacks([r for r in refs if r.row_id not in seen])
        seen |= {w.ref.row_id for w in watches}
        return watches, [ref for ref in refs if ref.row_id not in seen]

    def _asset_watchers(self, refs: Sequence[RowRef]) -> list[WatchRow]:
        sa, trigger, asset, watcher = self._sa, self._trigger, self._asset, self._watcher
        with self._db.session() as session:
            found = session.execute(
                sa.select(*self._row_columns(), asset.name, asset.uri)
                .join(watcher, watcher.trigger_id == trigger.id)
                .join(asset, asset.id == watcher.asset_id)
                .where(trigger.id.in_([r.row_id for r in refs]))
                .order_by(trigger.id, asset.name)
            ).all()
        rows: dict[int, tuple[Any, ...]] = {}
        assets: dict[int, list[tuple[str, str]]] = {}
        for row_id, created, classpath, encrypted, row_queue, name, uri in found:
            rows.setdefault(row_id, (created, classpath, encrypted, row_queue))
            assets.setdefault(row_id, []).append((name, uri))
        return [
            self._row(row_id, *columns, assets=tuple(assets[row_id]))
            for row_id, columns in rows.items()
        ]

    def _callbacks(self, refs: Sequence[RowRef]) -> list[WatchRow]:
        if not refs or not self._has_callbacks:
            return []
        sa, trigger = self._sa, self._trigger
        with self._db.session() as session:
            found = session.execute(
                sa.select(*self._row_columns()).where(
                    trigger.id.in_([r.row_id for r in refs]), trigger.callback.has()
                )
            ).all()
        return [self._row(*columns, assets=(), callback=True) for columns in found]

    def _row_columns(self) -> tuple[Any, ...]:
        """The trigger row's columns a :class:`WatchRow` is made of (:meth:`_row`'s order)."""
        trigger = self._trigger
        queue = getattr(trigger, "queue", None)  # 3.2+
        return (
            trigger.id,
            trigger.created_date,
            trigger.classpath,
            trigger.encrypted_kwargs,
            queue if queue is not None else self._sa.null(),
        )

    def _row(
        self,
        row_id: int,
        created: dt.datetime,
        classpath: str,
        encrypted: Any,
        queue: str | None,
        *,
        assets: tuple[tuple[str, str], ...],
        callback: bool = False,
    ) -> WatchRow:
        kwargs: dict[str, Any] | None
        try:
            kwargs, error = self._db.decrypt_kwargs(encrypted), None
        except Exception as exc:  # Airflow's key or serializer refused them
            kwargs, error = None, exc
        return WatchRow(
            ref=RowRef.of(row_id, created),
            classpath=classpath,
            kwargs=kwargs,
            kwargs_error=error,
            queue=queue,
            assets=assets,
            callback=callback,
        )

    def fail_callbacks(self, failures: Sequence[tuple[RowRef, str]]) -> None:
        """Record the callbacks of rows that cannot run in deferline as failed, saying why
        (Airflow's ``CallbackTrigger`` reports a callback it cannot import so)."""
        with self._db.session() as session:
            live = self._db.live(session, [ref for ref, _ in failures])
            for ref, reason in failures:
                if ref in live:
                    self._fail_callback(session, ref.row_id, reason)

    def _fail_callback(self, session: Any, row_id: int, reason: str) -> bool:
        """The row's callback recorded as failed with ``reason``; False without a callback."""
        row = session.get(self._trigger, row_id) if self._has_callbacks else None
        if row is None or row.callback is None:
            return False
        payload = {"state": "failed", "body": reason}  # CallbackTrigger's own keys
        row.callback.handle_event(self._event(payload), session)
        return True

    def apply(self, events: Sequence[WatchApply]) -> AppliedWatchEvents:
        """Apply ``events`` in one transaction, each once: a fired one through Airflow's
        ``Trigger.submit_event`` (an asset event per watched asset, the DAG runs it
        schedules queued), its id recorded beside. A batch that meets an id another bridge
        recorded meanwhile is rolled back and applied again without it."""
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                return self._apply(events)
            except self._conflict:
                if attempt == _ATTEMPTS:
                    raise
                logger.info("watch events applied elsewhere meanwhile; applying the rest")
        raise AssertionError("unreachable")

    def _apply(self, events: Sequence[WatchApply]) -> AppliedWatchEvents:
        sa, table = self._sa, self._applied
        first: dict[str, WatchApply] = {}
        for event in events:
            first.setdefault(event.event_id, event)
        fired = failed = stale = 0
        now = dt.datetime.now(dt.UTC)
        with self._db.session() as session:
            done = set(
                session.scalars(sa.select(table.c.event_id).where(table.c.event_id.in_(first)))
            )
            todo = [e for event_id, e in first.items() if event_id not in done]
            live = self._db.live(session, [e.ref for e in todo])
            for event in todo:
                if event.ref not in live:
                    stale += 1
                    continue
                session.execute(
                    sa.insert(table).values(
                        event_id=event.event_id, trigger_id=event.ref.row_id, applied_at=now
                    )
                )
                if event.status == "fired":
                    self._trigger.submit_event(
                        event.ref.row_id, self._event(event.payload), session=session
                    )
                    fired += 1
                    continue
                failed += 1
                reason = event.error or "the trigger failed in deferline"
                if self._fail_callback(session, event.ref.row_id, reason):
                    logger.warning(
                        "deadline-alert callback failed: %s",
                        reason,
                        extra={"row_id": event.ref.row_id, "event_id": event.event_id},
                    )
                else:
                    logger.warning(
                        "asset watcher run failed: %s",
                        reason,
                        extra={"row_id": event.ref.row_id, "event_id": event.event_id},
                    )
        return AppliedWatchEvents(
            fired=fired, failed=failed, repeated=len(events) - len(todo), stale=stale
        )

    def forget_applied(self, before: dt.datetime | None = None) -> int:
        """Delete the ids applied before ``before`` (default: :data:`KEEP_APPLIED` ago),
        which no event still on the resume topic can carry. Returns how many."""
        sa, table = self._sa, self._applied
        cutoff = before or dt.datetime.now(dt.UTC) - KEEP_APPLIED
        with self._db.session() as session:
            result = session.execute(sa.delete(table).where(table.c.applied_at < cutoff))
            return int(result.rowcount or 0)

    def applied_ids(self, trigger_ids: Collection[int]) -> set[str]:
        """The applied event ids of these rows (for replay and tests)."""
        sa, table = self._sa, self._applied
        with self._db.session() as session:
            return set(
                session.scalars(
                    sa.select(table.c.event_id).where(table.c.trigger_id.in_(list(trigger_ids)))
                )
            )
