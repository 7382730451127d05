"""Running an operator on a worker: its result, the records of a deferral, and loading an
operator class by its classpath under an allow-list."""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from deferline.schemas import (
    DeferRequest,
    ResumeTarget,
    TaskKey,
    TaskStateRecord,
    make_trigger_id,
    utcnow,
)

from ._airflow import prepare_airflow_import
from ._loader import is_allowed
from ._operator import (
    _DEFAULT_NEXT_METHOD,
    BaseOperator,
    Context,
    OperatorError,
    OperatorImportError,
    OperatorKwargsError,
    OperatorNotAllowed,
    SerializedTrigger,
    TaskDeferred,
    TaskSkipped,
)

__all__ = [
    "Deferred",
    "Failed",
    "OperatorResult",
    "Skipped",
    "Succeeded",
    "deferral_records",
    "import_operator",
    "load_operator",
    "run_operator",
    "start_deferral",
]


def start_deferral(operator: BaseOperator) -> TaskDeferred | None:
    """The deferral a ``start_from_trigger`` operator begins with, or None if it runs first."""
    args = operator.start_trigger_args
    if not operator.start_from_trigger or args is None:
        return None
    return TaskDeferred(
        trigger=SerializedTrigger(args.trigger_cls, args.trigger_kwargs or {}),
        method_name=args.next_method,
        kwargs=args.next_kwargs,
        timeout=args.timeout,
        end_from_trigger=operator.end_from_trigger,
    )


# --------------------------------------------------------------------------- running


@dataclasses.dataclass(frozen=True, slots=True)
class Succeeded:
    """The run returned: the task succeeded with ``value``."""

    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Deferred:
    """The run deferred: publish ``deferral`` and free the slot."""

    deferral: TaskDeferred


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """The run raised: ``error`` is the reason, ``retryable`` False for load errors."""

    error: str
    error_type: str
    traceback: str | None
    retryable: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class Skipped:
    """The run raised :class:`TaskSkipped`."""

    reason: str


OperatorResult = Succeeded | Deferred | Failed | Skipped


def run_operator(
    operator: BaseOperator,
    context: Context,
    *,
    next_method: str | None = None,
    next_kwargs: Mapping[str, Any] | None = None,
) -> OperatorResult:
    """Run one stretch of ``operator``: ``execute`` (start) or ``next_method`` (resume).

    Never raises for what operator code does: a deferral, a skip and any exception come
    back as values (KeyboardInterrupt and SystemExit still propagate).
    """
    try:
        if next_method is not None:
            value = operator.resume_execution(next_method, next_kwargs, context)
        else:
            deferral = start_deferral(operator)
            if deferral is not None:
                return Deferred(deferral)
            value = operator.execute(context)
    except TaskDeferred as deferral:
        return Deferred(deferral)
    except TaskSkipped as exc:
        return Skipped(str(exc))
    except Exception as exc:
        return Failed(
            error=str(exc) or type(exc).__name__,
            error_type=type(exc).__name__,
            traceback=traceback.format_exc(),
        )
    return Succeeded(value)


def deferral_records(
    task: TaskKey,
    deferral: TaskDeferred,
    *,
    defer_seq: int,
    resume: ResumeTarget | None,
    trigger_queue: str | None = None,
    source: Literal["worker", "client"] = "worker",
    now: dt.datetime | None = None,
) -> tuple[TaskStateRecord, DeferRequest]:
    """The "deferred" task state and the DeferRequest for one deferral (write them in order).

    Raises :class:`OperatorError` when the trigger cannot be serialized.
    """
    now = now or utcnow()
    try:
        classpath, kwargs = deferral.trigger.serialize()
    except Exception as exc:
        raise OperatorError(
            f"cannot serialize trigger {type(deferral.trigger).__name__}: {exc}"
        ) from exc
    trigger_id = make_trigger_id(task, defer_seq)
    timeout_at = now + deferral.timeout if deferral.timeout is not None else None
    next_method = deferral.method_name or _DEFAULT_NEXT_METHOD
    next_kwargs = deferral.kwargs or None
    state = TaskStateRecord(
        task=task,
        state="deferred",
        trigger_id=trigger_id,
        defer_seq=defer_seq,
        next_method=next_method,
        next_kwargs=next_kwargs,
        updated_at=now,
        source=source,
        resume=resume,
        timeout_at=timeout_at,
        queue=trigger_queue,
    )
    request = DeferRequest(
        trigger_id=trigger_id,
        task=task,
        defer_seq=defer_seq,
        classpath=classpath,
        kwargs=dict(kwargs),
        next_method=next_method,
        next_kwargs=next_kwargs,
        timeout_at=timeout_at,
        queue=trigger_queue,
        end_from_trigger=deferral.end_from_trigger,
        requested_at=now,
        resume=resume,
    )
    return state, request


# --------------------------------------------------------------------------- loading


def import_operator(classpath: str, *, allowed_prefixes: Sequence[str]) -> type[BaseOperator]:
    """Import the operator class at ``classpath`` if its module is allowed."""
    module_name, _, name = classpath.rpartition(".")
    if not module_name or not name.isidentifier():
        raise OperatorImportError(f"not a classpath: {classpath!r}", classpath=classpath)
    if not is_allowed(classpath, allowed_prefixes):
        raise OperatorNotAllowed(
            f"operator {classpath!r} is outside the allowed prefixes {list(allowed_prefixes)}",
            classpath=classpath,
        )
    prepare_airflow_import()  # an operator module may defer on Airflow's triggers
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise OperatorImportError(
            f"cannot import {module_name!r}: {type(exc).__name__}: {exc}", classpath=classpath
        ) from exc
    cls = getattr(module, name, None)
    if cls is None:
        raise OperatorImportError(f"{module_name!r} has no {name!r}", classpath=classpath)
    if not (isinstance(cls, type) and issubclass(cls, BaseOperator)):
        raise OperatorNotAllowed(f"{classpath!r} is not a BaseOperator", classpath=classpath)
    return cls


def load_operator(
    classpath: str,
    op_kwargs: Mapping[str, Any],
    *,
    task_id: str,
    allowed_prefixes: Sequence[str],
) -> BaseOperator:
    """Build a fresh operator instance: import (allowlisted) and call it with ``op_kwargs``."""
    cls = import_operator(classpath, allowed_prefixes=allowed_prefixes)
    kwargs = dict(op_kwargs)
    kwargs.setdefault("task_id", task_id)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise OperatorKwargsError(
            f"{classpath} rejected its kwargs: {exc}", classpath=classpath
        ) from exc
    except Exception as exc:
        raise OperatorKwargsError(
            f"{classpath}(...) raised {type(exc).__name__}: {exc}", classpath=classpath
        ) from exc
