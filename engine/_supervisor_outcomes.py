"""The supervisor's outcomes: how each is built, and the sink that hands them to
``on_event``, counting and logging them."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any

from deferline.schemas import make_event_id, to_tagged

from ._metrics import SupervisorMetrics
from ._outcome import TriggerOutcome
from ._supervisor_state import _UTC, _from_epoch, _log_extra
from ._trigger import BaseTaskEndEvent

logger = logging.getLogger(__name__)


def fired_outcome(
    tid: str,
    payload: Any,
    end: BaseTaskEndEvent | None,
    context: object,
    final: bool,
    due: dt.datetime | None,
    fired_at: dt.datetime,
    canonical: bytes | None = None,
) -> TriggerOutcome:
    """A ``fired`` outcome; raises if the payload or the xcoms cannot be serialized.

    ``canonical``: the payload's canonical JSON, when the caller has it already. (Called
    once per fired timer: positional arguments keep the call cheap.)
    """
    event_id = make_event_id(tid, "fired", payload, canonical=canonical)
    xcoms = None if end is None else end.xcoms
    if xcoms is not None:
        to_tagged(xcoms)
    return TriggerOutcome(
        tid,
        "fired",
        payload,
        event_id,
        None if end is None else end.task_instance_state,  # type: ignore[arg-type]
        xcoms,
        None,
        None,
        due,
        fired_at,
        context,
        final,
    )


class OutcomeSink:
    """Hands each outcome to ``on_event`` and counts it; what ``on_event`` raises is logged
    and counted, never propagated."""

    __slots__ = ("_metrics", "_on_event")

    def __init__(
        self, on_event: Callable[[TriggerOutcome], None], metrics: SupervisorMetrics
    ) -> None:
        self._on_event = on_event
        self._metrics = metrics

    def fired(self, outcome: TriggerOutcome) -> None:
        """Hand over a ``fired`` outcome (once per fired timer: one call, not two)."""
        self._metrics.fired += 1
        try:
            self._on_event(outcome)
        except Exception:
            self._callback_failed(outcome)

    def failed(
        self, tid: str, context: object, message: str, tb: str | None, *, verb: str = "failed"
    ) -> None:
        """Build and hand over a final ``failed`` outcome (logged as "trigger <verb>")."""
        self._metrics.failed += 1
        logger.warning("trigger %s: %s", verb, message, extra=_log_extra(tid, context))
        self._deliver(
            TriggerOutcome(
                tid,
                "failed",
                None,
                make_event_id(tid, "failed", None),
                None,
                None,
                message,
                tb,
                None,
                dt.datetime.now(_UTC),
                context,
                True,
            )
        )

    def timed_out(self, tid: str, deadline: float, context: object) -> None:
        """Build and hand over a final ``timed_out`` outcome for a timeout due at ``deadline``."""
        fired = time.time()
        self._metrics.timed_out += 1
        self._metrics.fire_lag.observe(fired - deadline)
        due = _from_epoch(deadline)
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "trigger timed out (due %s)", due.isoformat(), extra=_log_extra(tid, context)
            )
        self._deliver(
            TriggerOutcome(
                tid,
                "timed_out",
                None,
                make_event_id(tid, "timed_out", None),
                None,
                None,
                f"trigger timed out at {due.isoformat()}",
                None,
                due,
                _from_epoch(fired),
                context,
                True,
            )
        )

    def _deliver(self, outcome: TriggerOutcome) -> None:
        try:
            self._on_event(outcome)
        except Exception:
            self._callback_failed(outcome)

    def _callback_failed(self, outcome: TriggerOutcome) -> None:
        """Count and log what ``on_event`` raised (called from its ``except`` block)."""
        self._metrics.callback_errors += 1
        logger.exception(
            "on_event raised for %s outcome",
            outcome.status,
            extra=_log_extra(outcome.trigger_id, outcome.context),
        )
