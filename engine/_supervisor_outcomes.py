"""The supervisor's outcomes: fired events, failures and timeouts handed to ``on_event``."""

from __future__ import annotations

import datetime as dt
import logging
import time
import traceback

from deferline.schemas import make_event_id, to_tagged

from ._outcome import TriggerOutcome
from ._supervisor_state import (
    _FINISHING,
    _RUNNING,
    _UTC,
    _classpath,
    _describe_error,
    _from_epoch,
    _log_extra,
    _Run,
    _SupervisorCore,
)
from ._trigger import BaseTaskEndEvent, TriggerEvent

logger = logging.getLogger(__name__)


class _Outcomes(_SupervisorCore):
    """Outcomes of a :class:`TriggerSupervisor` (a part of it, not used alone)."""

    def _emit_event(self, run: _Run, event: TriggerEvent, *, final: bool) -> bool:
        """Emit one event; False (and a failure instead) when it cannot be serialized."""
        if run.state != _RUNNING:
            return False
        payload = event.payload
        end = event if isinstance(event, BaseTaskEndEvent) else None
        xcoms = None if end is None else end.xcoms
        try:
            event_id = make_event_id(run.tid, "fired", payload)
            if xcoms is not None:
                to_tagged(xcoms)
        except Exception as exc:
            self._fail(
                run, f"{_classpath(run.trigger)} yielded an event that cannot be serialized: {exc}"
            )
            return False
        if final:
            run.state = _FINISHING
        self.metrics.fired += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("trigger fired", extra=_log_extra(run.tid, run.context))
        self._deliver(
            TriggerOutcome(
                run.tid,
                "fired",
                payload,
                event_id,
                None if end is None else end.task_instance_state,  # type: ignore[arg-type]
                xcoms,
                None,
                None,
                None,
                dt.datetime.now(_UTC),
                run.context,
                final,
            )
        )
        return True

    def _fail(self, run: _Run, error: BaseException | str) -> None:
        if run.state != _RUNNING:
            return
        run.state = _FINISHING
        if isinstance(error, BaseException):
            message = _describe_error(error)
            tb = "".join(traceback.format_exception(error))
        else:
            message, tb = error, None
        self._emit_failure(run.tid, run.context, message, tb)

    def _emit_failure(self, tid: str, context: object, message: str, tb: str | None) -> None:
        self.metrics.failed += 1
        logger.warning("trigger failed: %s", message, extra=_log_extra(tid, context))
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

    def _emit_timeout(self, tid: str, deadline: float, context: object) -> None:
        fired = time.time()
        self.metrics.timed_out += 1
        self.metrics.fire_lag.observe(fired - deadline)
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
            self.metrics.callback_errors += 1
            logger.exception(
                "on_event raised for %s outcome",
                outcome.status,
                extra=_log_extra(outcome.trigger_id, outcome.context),
            )
