"""The operator API: class-based tasks that run on workers and defer to triggers.

Shaped like Airflow's (``BaseOperator.execute(context)``, ``self.defer(...)`` raising
:class:`TaskDeferred` from any depth, resume through ``method_name(context, event=...)`` on a
fresh instance, ``start_from_trigger`` and ``end_from_trigger``), so an Airflow-style
deferrable operator needs only its imports changed. Everything here is pure: the worker
runtime in ``deferline.runners`` moves the bytes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal, NoReturn, Protocol, TypedDict

from deferline.schemas import (
    DeferlineError,
    TaskKey,
    utcnow,
)

from ._taskstate_values import FAIL_METHOD
from ._trigger import BaseTrigger, TriggerEvent

__all__ = [
    "BaseOperator",
    "BaseSensorOperator",
    "Context",
    "OperatorError",
    "OperatorImportError",
    "OperatorKwargsError",
    "OperatorLoadError",
    "OperatorNotAllowed",
    "SensorTimeout",
    "SerializedTrigger",
    "StartTriggerArgs",
    "TaskDeferralError",
    "TaskDeferralTimeout",
    "TaskDeferred",
    "TaskSkipped",
    "make_context",
]

logger = logging.getLogger(__name__)


_DEFAULT_NEXT_METHOD = "execute_complete"


# --------------------------------------------------------------------------- errors


class OperatorError(DeferlineError):
    """An operator could not be loaded or run as asked."""


class OperatorLoadError(OperatorError):
    """A RunTask names an operator that cannot be turned into an instance."""

    def __init__(self, message: str, *, classpath: str) -> None:
        super().__init__(message)
        self.classpath = classpath


class OperatorNotAllowed(OperatorLoadError):
    """The classpath is outside the allowed module prefixes, or is not a BaseOperator."""


class OperatorImportError(OperatorLoadError):
    """The operator's module or class could not be imported."""


class OperatorKwargsError(OperatorLoadError):
    """The operator class rejected its keyword arguments."""


class TaskDeferralError(OperatorError):
    """The trigger a task deferred on failed, so the task fails (resumed into ``__fail__``)."""


class TaskDeferralTimeout(TaskDeferralError):
    """The deferral's timeout passed before its trigger fired."""


class SensorTimeout(OperatorError):
    """A sensor's condition was not met within its timeout."""


class TaskSkipped(OperatorError):
    """Raise from operator code to end the task as skipped (Airflow's AirflowSkipException)."""


# --------------------------------------------------------------------------- deferral


class SerializableTrigger(Protocol):
    """What a worker needs of a trigger: Airflow's ``serialize()`` contract.

    Satisfied by deferline's ``BaseTrigger`` and by Airflow's own trigger classes, so an
    operator may defer on ``airflow.triggers.temporal.DateTimeTrigger(...)`` unchanged.
    """

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return ``(classpath, kwargs)`` from which the trigger can be rebuilt."""
        ...


class TaskDeferred(BaseException):
    """Raised to suspend a task until ``trigger`` fires; ``self.defer`` raises it.

    A ``BaseException`` (as in Airflow) so that a broad ``except Exception`` in operator code
    cannot swallow the deferral. ``timeout`` counts from the moment of deferring.
    """

    def __init__(
        self,
        *,
        trigger: BaseTrigger | SerializableTrigger,
        method_name: str | None,
        kwargs: Mapping[str, Any] | None = None,
        timeout: dt.timedelta | float | None = None,
        end_from_trigger: bool = False,
    ) -> None:
        if not callable(getattr(trigger, "serialize", None)):
            raise TypeError(f"trigger must be a BaseTrigger, got {type(trigger).__name__}")
        if isinstance(timeout, bool) or (
            timeout is not None and not isinstance(timeout, dt.timedelta | int | float)
        ):
            raise TypeError(f"timeout must be a timedelta or seconds, got {timeout!r}")
        if isinstance(timeout, int | float):
            timeout = dt.timedelta(seconds=timeout)
        if method_name is None and not end_from_trigger:
            raise ValueError("method_name is required unless the trigger ends the task")
        super().__init__(trigger, method_name, kwargs, timeout)
        self.trigger: BaseTrigger | SerializableTrigger = trigger
        self.method_name = method_name
        self.kwargs: dict[str, Any] = dict(kwargs or {})
        self.timeout: dt.timedelta | None = timeout
        self.end_from_trigger = end_from_trigger

    def __repr__(self) -> str:
        return f"<TaskDeferred trigger={self.trigger!r} method={self.method_name}>"


@dataclasses.dataclass(frozen=True)
class StartTriggerArgs:
    """The trigger a ``start_from_trigger`` operator waits on before its first worker run.

    Change it per instance with ``dataclasses.replace(self.start_trigger_args, ...)``; the
    instance is frozen so a class-level default is never mutated by accident.
    """

    trigger_cls: str
    next_method: str = _DEFAULT_NEXT_METHOD
    trigger_kwargs: dict[str, Any] | None = None
    next_kwargs: dict[str, Any] | None = None
    timeout: dt.timedelta | None = None


class SerializedTrigger(BaseTrigger):
    """A trigger known only by its classpath and kwargs; published as is, never run here."""

    def __init__(self, classpath: str, kwargs: Mapping[str, Any]) -> None:
        super().__init__()
        self._classpath = classpath
        self._kwargs = dict(kwargs)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return self._classpath, dict(self._kwargs)

    def run(self) -> AsyncIterator[TriggerEvent]:  # pragma: no cover - never run here
        raise OperatorError("a serialized trigger runs on a triggerer, not here")


# --------------------------------------------------------------------------- context


class Context(TypedDict):
    """What operator code is called with: the task attempt and, on resume, the event."""

    ti: TaskKey
    """The task attempt being run."""
    ti_key: str
    dag_id: str
    task_id: str
    run_id: str
    map_index: int
    try_number: int
    params: dict[str, Any]
    task: BaseOperator
    trigger_id: str | None
    """The trigger that resumed this run (None on the first run)."""
    defer_seq: int
    """How many times this attempt deferred before this run."""
    event: Any
    """The payload of the trigger event that resumed this run (None on the first run)."""
    event_id: str | None


def make_context(
    operator: BaseOperator,
    task: TaskKey,
    *,
    trigger_id: str | None = None,
    defer_seq: int = 0,
    event: Any = None,
    event_id: str | None = None,
) -> Context:
    """Build the context of one run of ``operator`` for attempt ``task``."""
    return Context(
        ti=task,
        ti_key=task.ti_key,
        dag_id=task.dag_id,
        task_id=task.task_id,
        run_id=task.run_id,
        map_index=task.map_index,
        try_number=task.try_number,
        params=dict(operator.params),
        task=operator,
        trigger_id=trigger_id,
        defer_seq=defer_seq,
        event=event,
        event_id=event_id,
    )


# --------------------------------------------------------------------------- operators


def _seconds(value: dt.timedelta | float) -> float:
    return value.total_seconds() if isinstance(value, dt.timedelta) else float(value)


class BaseOperator:
    """Base class of every task that runs on a worker.

    Subclasses implement :meth:`execute`; to wait, they call :meth:`defer` (from any depth)
    and name the method to resume in. Nothing set on ``self`` survives a deferral: the task
    resumes on a fresh instance built from the same ``op_kwargs``, so state travels in the
    defer ``kwargs``.

    Args:
        task_id: the task's id; the worker passes the task key's ``task_id``.
        retries: failed attempts retried before the task fails (the RunTask's value wins).
        pool, pool_slots, priority_weight: scheduling hints used when submitting by class.
        queue: the worker queue the task runs on.
        trigger_queue: the trigger queue its deferrals go to (None: the default queue).
        params: user parameters, exposed as ``context["params"]``.
    """

    start_from_trigger: bool = False
    """Defer to ``start_trigger_args`` at start without running on a worker first."""
    start_trigger_args: StartTriggerArgs | None = None
    end_from_trigger: bool = False
    """Deferrals may end the task from the trigger (TaskSuccessEvent and friends)."""

    def __init__(
        self,
        *,
        task_id: str | None = None,
        retries: int = 0,
        pool: str = "default_pool",
        pool_slots: int = 1,
        priority_weight: int = 1,
        queue: str = "default",
        trigger_queue: str | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self.task_id = task_id or type(self).__name__
        self.retries = retries
        self.pool = pool
        self.pool_slots = pool_slots
        self.priority_weight = priority_weight
        self.queue = queue
        self.trigger_queue = trigger_queue
        self.params: dict[str, Any] = dict(params or {})
        self.log = logging.getLogger(f"{type(self).__module__}.{type(self).__qualname__}")

    def execute(self, context: Context) -> Any:
        """Do the task's work; the return value is the task's result."""
        raise NotImplementedError(f"{type(self).__name__} does not implement execute()")

    def defer(
        self,
        *,
        trigger: BaseTrigger | SerializableTrigger,
        method_name: str | None,
        kwargs: Mapping[str, Any] | None = None,
        timeout: dt.timedelta | float | None = None,
    ) -> NoReturn:
        """Suspend the task until ``trigger`` fires, then resume in ``method_name``.

        ``trigger`` is a deferline trigger or any object with Airflow's ``serialize()``
        contract, such as ``airflow.triggers.temporal.DateTimeTrigger(...)`` itself: only its
        ``(classpath, kwargs)`` travel in the DeferRequest, and the triggerer rebuilds it.

        ``kwargs`` are passed to that method along with ``context`` and ``event``;
        ``timeout`` fails the task if the trigger has not fired by then.
        """
        raise TaskDeferred(
            trigger=trigger,
            method_name=method_name,
            kwargs=kwargs,
            timeout=timeout,
            end_from_trigger=self.end_from_trigger,
        )

    def resume_execution(
        self, next_method: str, next_kwargs: Mapping[str, Any] | None, context: Context
    ) -> Any:
        """Call ``next_method(context, event=..., **next_kwargs)``; ``__fail__`` raises."""
        kwargs = dict(next_kwargs or {})
        if next_method == FAIL_METHOD:
            _raise_trigger_failure(kwargs, context["event"])
        if next_method.startswith("_"):
            raise OperatorError(f"refusing to resume into private method {next_method!r}")
        method = getattr(self, next_method, None)
        if not callable(method):
            raise OperatorError(f"{type(self).__name__} has no method {next_method!r} to resume")
        kwargs["event"] = context["event"]
        return method(context, **kwargs)


def _raise_trigger_failure(next_kwargs: Mapping[str, Any], event: Any) -> NoReturn:
    """Airflow's ``__fail__``: raise the failure the trigger reported."""
    detail = event if isinstance(event, Mapping) else {}
    error = next_kwargs.get("error") or detail.get("error") or next_kwargs.get("reason")
    if error is None and isinstance(event, str):
        error = event
    status = next_kwargs.get("status") or detail.get("status")
    trace = next_kwargs.get("traceback") or detail.get("traceback")
    if trace:
        logger.error("trigger failed:\n%s", trace if isinstance(trace, str) else "\n".join(trace))
    message = str(error or "trigger failed")
    if status == "timed_out":
        raise TaskDeferralTimeout(message)
    raise TaskDeferralError(message)


class BaseSensorOperator(BaseOperator):
    """A task that waits until :meth:`poke` returns True.

    Three ways to wait, from most to least worker time held:

    - ``mode="poke"`` (default, not deferrable): poke every ``poke_interval`` seconds inside
      the worker slot, holding it for the whole wait;
    - ``deferrable=True`` with :meth:`make_trigger` returning a trigger: poke once, then
      defer on that trigger (the slot is free until it fires);
    - ``deferrable=True`` without one, or ``mode="reschedule"``: poke, then defer on a timer
      of ``poke_interval`` and poke again on resume (the slot is held only while poking).

    Args:
        poke_interval: seconds between pokes.
        timeout: seconds from the first poke after which the sensor fails
            (or is skipped with ``soft_fail``).
        mode: ``"poke"`` or ``"reschedule"``.
        deferrable: wait on a trigger instead of in the worker slot.
        soft_fail: end as skipped instead of failed on timeout.
    """

    def __init__(
        self,
        *,
        poke_interval: dt.timedelta | float = 60.0,
        timeout: dt.timedelta | float = 7 * 24 * 3600.0,
        mode: Literal["poke", "reschedule"] = "poke",
        deferrable: bool = False,
        soft_fail: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if mode not in ("poke", "reschedule"):
            raise ValueError(f"mode must be 'poke' or 'reschedule', got {mode!r}")
        self.poke_interval = _seconds(poke_interval)
        self.timeout = _seconds(timeout)
        if self.poke_interval < 0 or self.timeout < 0:
            raise ValueError("poke_interval and timeout must not be negative")
        self.mode = mode
        self.deferrable = deferrable
        self.soft_fail = soft_fail

    def poke(self, context: Context) -> bool:
        """Return True once the condition is met."""
        raise NotImplementedError(f"{type(self).__name__} does not implement poke()")

    def make_trigger(self, context: Context) -> BaseTrigger | None:
        """The trigger a deferrable sensor waits on; None polls ``poke`` on a timer instead."""
        return None

    def execute(self, context: Context) -> Any:
        if self.deferrable or self.mode == "reschedule":
            if self.poke(context):
                return None
            trigger = self.make_trigger(context) if self.deferrable else None
            if trigger is not None:
                self.defer(trigger=trigger, method_name="execute_complete", timeout=self.timeout)
            self._wait_for_next_poke(utcnow())
        started = time.monotonic()
        while not self.poke(context):
            if time.monotonic() - started >= self.timeout:
                self._timed_out()
            time.sleep(self.poke_interval)
        return None

    def execute_complete(self, context: Context, event: Any = None) -> Any:
        """Resumed after the sensor's trigger fired: the condition is met."""
        return None

    def resume_poke(
        self, context: Context, event: Any = None, *, first_poke_at: dt.datetime
    ) -> Any:
        """Resumed after a poke interval: poke again, then wait again or time out."""
        if self.poke(context):
            return None
        self._wait_for_next_poke(first_poke_at)

    def _wait_for_next_poke(self, first_poke_at: dt.datetime) -> NoReturn:
        from .triggers import TimeDeltaTrigger  # the built-ins import this module's siblings

        if (utcnow() - first_poke_at).total_seconds() >= self.timeout:
            self._timed_out()
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=self.poke_interval)),
            method_name="resume_poke",
            kwargs={"first_poke_at": first_poke_at},
        )

    def resume_execution(
        self, next_method: str, next_kwargs: Mapping[str, Any] | None, context: Context
    ) -> Any:
        try:
            return super().resume_execution(next_method, next_kwargs, context)
        except TaskDeferralTimeout as exc:
            if self.soft_fail:
                raise TaskSkipped(str(exc)) from exc
            raise

    def _timed_out(self) -> NoReturn:
        message = f"sensor {self.task_id} timed out after {self.timeout:g}s"
        if self.soft_fail:
            raise TaskSkipped(message)
        raise SensorTimeout(message)
