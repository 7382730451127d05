"""Each trigger's own log lines, shipped to the ``trigger.logs`` topic (``--trigger-logs``).

Airflow shows a deferred task's trigger lines inside the task's log in its UI; its triggerer
writes them to a file per trigger. Here the triggers run in deferline's triggerers, away from
Airflow's log folder, so a triggerer collects the lines its triggers log (``self.log``, any
logger), attributed by :func:`deferline.engine.current_trigger_id`, masks the secrets
Airflow's masker knows, and ships them in batches keyed by trigger id; the Airflow bridge
writes them where Airflow's log reader finds them (docs/airflow.md, "Trigger logs").

Bounded, so a trigger that logs thousands of lines a second slows neither its loop nor a
resume: a line costs its formatting and an append; past ``bound`` lines waiting, a line is
dropped and counted (``deferline_triggerer_trigger_log_lines_dropped_total``), and the next
batch of that trigger says how many went. Shipping is best effort: plain sends, outside the
partitions' transactions, retried by the producer; lines still waiting when a triggerer dies
are lost with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from deferline.engine import current_trigger_id, redact_secrets
from deferline.schemas import LogLine, TriggerLogRecord, encode

logger = logging.getLogger(__name__)

SHIP_INTERVAL: Final = 0.5
"""Seconds between two batches."""
DEFAULT_BOUND: Final = 20_000
"""Lines waiting to be shipped, all triggers together, past which new lines are dropped."""
_LINES_PER_RECORD: Final = 500
_UTC = dt.UTC
_OWN_LOGGERS: Final = ("deferline.", "aiokafka", "kafka")
"""Loggers of the triggerer itself and its clients: their lines about a trigger are not the
trigger's (the built-in triggers, under ``deferline.engine.triggers``, are)."""
_TRIGGERS: Final = "deferline.engine.triggers."


class TriggerLogCapture(logging.Handler):
    """A logging handler that keeps the lines logged inside triggers, up to a bound.

    Owns ``_lines`` (waiting to be shipped) and ``_dropped`` (per trigger, since its last
    batch); the shipper takes both through :meth:`take`, under the handler's lock (lines
    come from the loop and from the threads triggers hand work to).
    """

    def __init__(self, *, bound: int = DEFAULT_BOUND, on_drop: Callable[[], None]) -> None:
        super().__init__(level=logging.DEBUG)
        self._bound = bound
        self._on_drop = on_drop
        self._lines: deque[tuple[str, LogLine]] = deque()
        self._dropped: dict[str, int] = {}
        self._formatter = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        trigger_id = current_trigger_id()
        name = record.name
        if trigger_id is None or (name.startswith(_OWN_LOGGERS) and not name.startswith(_TRIGGERS)):
            return  # not a trigger's line, or deferline's own about the trigger
        if len(self._lines) >= self._bound:
            self._dropped[trigger_id] = self._dropped.get(trigger_id, 0) + 1
            self._on_drop()
            return
        try:
            message = record.getMessage()
            if record.exc_info:
                message = f"{message}\n{self._formatter.formatException(record.exc_info)}"
            line = LogLine.model_construct(
                at=dt.datetime.fromtimestamp(record.created, _UTC),
                level=record.levelname.lower(),
                logger=record.name,
                message=redact_secrets(message),
            )
        except Exception:
            self.handleError(record)
            return
        self._lines.append((trigger_id, line))

    def take(self) -> tuple[list[tuple[str, LogLine]], dict[str, int]]:
        """What is waiting, and the drops since the last take; both emptied."""
        self.acquire()
        try:
            lines, self._lines = list(self._lines), deque()
            dropped, self._dropped = self._dropped, {}
        finally:
            self.release()
        return lines, dropped


def batches(
    lines: list[tuple[str, LogLine]], dropped: dict[str, int], member: str | None
) -> list[TriggerLogRecord]:
    """The records of one shipping round: per trigger, its lines in order, in records of at
    most :data:`_LINES_PER_RECORD`, the first carrying what was dropped before them."""
    by_trigger: dict[str, list[LogLine]] = {tid: [] for tid in dropped}
    for trigger_id, line in lines:
        by_trigger.setdefault(trigger_id, []).append(line)
    records = []
    for trigger_id, its_lines in by_trigger.items():
        missed = dropped.get(trigger_id, 0)
        for start in range(0, max(len(its_lines), 1), _LINES_PER_RECORD):
            records.append(
                TriggerLogRecord(
                    trigger_id=trigger_id,
                    member=member,
                    lines=its_lines[start : start + _LINES_PER_RECORD],
                    dropped=missed if start == 0 else 0,
                )
            )
    return records


class TriggerLogShipper:
    """Installs a :class:`TriggerLogCapture` on the root logger and ships what it keeps."""

    def __init__(
        self,
        *,
        producer: Any,
        topic: str,
        member: str,
        bound: int = DEFAULT_BOUND,
        on_drop: Callable[[], None],
        on_sent: Callable[[int], None],
    ) -> None:
        self._producer = producer
        self._topic = topic
        self._member = member
        self._on_sent = on_sent
        self.capture = TriggerLogCapture(bound=bound, on_drop=on_drop)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        logging.getLogger().addHandler(self.capture)
        self._task = asyncio.create_task(self._ship_loop(), name="trigger-logs")

    async def stop(self) -> None:
        """Ship what is waiting, once, and stop capturing."""
        logging.getLogger().removeHandler(self.capture)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ship_once(), 5.0)

    async def _ship_loop(self) -> None:
        while True:
            await asyncio.sleep(SHIP_INTERVAL)
            try:
                await self.ship_once()
            except Exception as exc:  # best effort: the next round carries on
                logger.warning("trigger log lines not shipped: %r", exc)

    async def ship_once(self) -> int:
        """Send what is waiting; the number of lines sent."""
        lines, dropped = self.capture.take()
        if not lines and not dropped:
            return 0
        sends = [
            await self._producer.send(self._topic, encode(record), key=record.trigger_id.encode())
            for record in batches(lines, dropped, self._member)
        ]
        await asyncio.gather(*sends)
        self._on_sent(len(lines))
        return len(lines)
