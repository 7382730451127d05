"""The scheduler's fold: input records into the task table, decisions out. No I/O.

:class:`TaskFold` owns the :class:`~deferline.engine.TaskTable` and the task states this
scheduler wrote and has not read back yet; the I/O shell (:mod:`._scheduler`) feeds it
records as the consumers return them and publishes what :meth:`TaskFold.drain` hands out.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from deferline.engine import Emit, LedgerAdmission, Pools, TaskTable, WrittenState
from deferline.schemas import SchemaError, TaskStateRecord

from ._records import read_as, read_event

__all__ = ["TaskFold"]

logger = logging.getLogger(__name__)


class TaskFold:
    """Task states and trigger events folded into one table.

    ``written`` maps the encoded value of each task state this scheduler published, and
    has not read back yet, to the state as the table takes it back: read back, it is folded
    without decoding.
    """

    __slots__ = ("bad_records", "table", "written")

    def __init__(
        self, pools: Pools | None = None, *, ledger: LedgerAdmission | None = None
    ) -> None:
        """``ledger``: admit limited pools through the pool ledger (see
        :class:`~deferline.engine.LedgerAdmission`); by default the table admits them."""
        self.table = TaskTable(pools=pools, ledger=ledger)
        self.written: dict[bytes, WrittenState] = {}
        self.bad_records = 0

    def reset(self) -> None:
        """Start again from an empty table that tracks its changes (a checkpoint that did
        not restore)."""
        self.table = TaskTable(pools=self.table.pools, ledger=self.table.ledger)
        self.table.track_changes()

    def task(self, key: bytes | None, value: bytes | None, *, live: bool) -> str | None:
        """Fold a tasks-topic record; the reason it is unreadable, if it is and ``live``
        (records read while recovering were dead-lettered when first read live)."""
        if value is None:
            if key is not None:
                self.table.forget(key.decode("utf-8", "replace"))
            return None
        own = self.written.pop(value, None)
        if own is not None:  # one of this scheduler's writes, read back: no need to decode
            self.table.apply(own)
            return None
        try:
            self.table.apply(read_as(value, TaskStateRecord))
        except SchemaError as exc:
            return self._bad(exc, live=live)
        return None

    def event(self, value: bytes | None, *, ref: Hashable, resend: bool = False) -> str | None:
        """Fold a trigger event; the reason it is unreadable, if it is."""
        if value is None:
            return None
        try:
            self.table.apply(read_event(value), ref=ref, resend=resend)
        except SchemaError as exc:
            return self._bad(exc, live=True)
        return None

    def drain(self) -> list[Emit]:
        """The decisions taken since the last drain, to publish in this order."""
        return self.table.drain()

    def forget_unread_writes(self) -> None:
        """Writes not read back yet are read (and decoded) as any record from now on."""
        self.written.clear()

    def _bad(self, exc: SchemaError, *, live: bool) -> str | None:
        self.bad_records += 1
        logger.warning("unreadable record skipped: %s", exc, extra={"field": exc.field})
        return f"{type(exc).__name__}: {exc}" if live else None
