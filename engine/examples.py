"""Example operators: small, runnable, and importable by classpath.

``deferline.engine.examples`` is the default ``allowed_operator_prefixes``, so a worker runs
these out of the box (``deferline submit deferline.engine.examples.WaitOperator ...``). Each
shows one way of waiting; read them as templates for your own operators.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from deferline.schemas import utcnow

from ._operator import BaseOperator, BaseSensorOperator, Context, StartTriggerArgs
from ._trigger import BaseTrigger
from .triggers import (
    DateTimeTrigger,
    FileTrigger,
    HttpTrigger,
    KafkaMessageTrigger,
    TimeDeltaTrigger,
)

__all__ = [
    "DateTimeSensor",
    "FailingOperator",
    "FileSensor",
    "FlakyOperator",
    "HttpSensor",
    "KafkaMessageOperator",
    "MultiWaitOperator",
    "StartFromTriggerWaitOperator",
    "WaitOperator",
]


class WaitOperator(BaseOperator):
    """Wait ``seconds`` on a timer trigger, then return ``result``.

    With ``end_from_trigger=True`` the trigger ends the task itself (no second worker run);
    with ``timeout`` shorter than ``seconds`` the deferral times out and the task fails.
    """

    def __init__(
        self,
        *,
        seconds: float,
        result: Any = None,
        timeout: float | None = None,
        end_from_trigger: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds
        self.result = result
        self.timeout = timeout
        self.end_from_trigger = end_from_trigger

    def execute(self, context: Context) -> Any:
        self.defer(
            trigger=TimeDeltaTrigger(
                dt.timedelta(seconds=self.seconds), end_from_trigger=self.end_from_trigger
            ),
            method_name="execute_complete",
            kwargs={"deferred_at": utcnow()},
            timeout=self.timeout,
        )

    def execute_complete(
        self, context: Context, event: Any = None, *, deferred_at: dt.datetime
    ) -> Any:
        waited = (utcnow() - deferred_at).total_seconds()
        self.log.info("waited %.3fs for %s", waited, context["ti"])
        return self.result


class MultiWaitOperator(BaseOperator):
    """Defer once per entry of ``waits`` (seconds), resuming into ``execute`` each time.

    Airflow's "deferring multiple times" pattern: the position travels in the defer kwargs
    because nothing set on ``self`` survives a deferral.
    """

    def __init__(self, *, waits: Sequence[float], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.waits = list(waits)

    def execute(self, context: Context, index: int = 0, event: Any = None) -> Any:
        if index >= len(self.waits):
            return index
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=self.waits[index])),
            method_name="execute",
            kwargs={"index": index + 1},
        )


class StartFromTriggerWaitOperator(BaseOperator):
    """Wait ``seconds`` before ever running on a worker (``start_from_trigger``).

    Submitted through the client, the task goes straight to the triggerer: no worker slot is
    taken until the timer fires and ``execute_complete`` runs.
    """

    start_from_trigger = True
    start_trigger_args = StartTriggerArgs(
        trigger_cls="deferline.engine.triggers.DateTimeTrigger",
        next_method="execute_complete",
    )

    def __init__(self, *, seconds: float, result: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.result = result
        moment = utcnow() + dt.timedelta(seconds=seconds)
        self.start_trigger_args = dataclasses.replace(
            type(self).start_trigger_args or StartTriggerArgs(trigger_cls=""),
            trigger_kwargs={"moment": moment},
        )

    def execute(self, context: Context) -> Any:
        # Reached only when start_from_trigger is switched off for an instance.
        return self.result

    def execute_complete(self, context: Context, event: Any = None) -> Any:
        return self.result


class FileSensor(BaseSensorOperator):
    """Wait until ``filepath`` exists (deferrable: on a FileTrigger)."""

    def __init__(self, *, filepath: str, **kwargs: Any) -> None:
        kwargs.setdefault("poke_interval", 5.0)
        super().__init__(**kwargs)
        self.filepath = filepath

    def poke(self, context: Context) -> bool:
        return os.path.exists(self.filepath)

    def make_trigger(self, context: Context) -> BaseTrigger:
        return FileTrigger(self.filepath, poll_interval=max(self.poke_interval, 0.05))


class DateTimeSensor(BaseSensorOperator):
    """Wait until ``target_time`` (deferrable: on a DateTimeTrigger; else poking in the slot)."""

    def __init__(self, *, target_time: dt.datetime | str, **kwargs: Any) -> None:
        kwargs.setdefault("poke_interval", 1.0)
        super().__init__(**kwargs)
        if isinstance(target_time, str):
            target_time = dt.datetime.fromisoformat(target_time)
        if target_time.tzinfo is None:
            raise ValueError("target_time must be timezone-aware")
        self.target_time = target_time

    def poke(self, context: Context) -> bool:
        return utcnow() >= self.target_time

    def make_trigger(self, context: Context) -> BaseTrigger:
        return DateTimeTrigger(self.target_time)


class HttpSensor(BaseSensorOperator):
    """Wait until ``url`` answers with ``expected_status`` (deferrable: on an HttpTrigger)."""

    def __init__(self, *, url: str, expected_status: int = 200, **kwargs: Any) -> None:
        kwargs.setdefault("poke_interval", 5.0)
        super().__init__(**kwargs)
        self.url = url
        self.expected_status = expected_status

    def poke(self, context: Context) -> bool:
        try:
            with urllib.request.urlopen(self.url, timeout=10) as response:
                return bool(response.status == self.expected_status)
        except urllib.error.HTTPError as exc:
            return exc.code == self.expected_status
        except (urllib.error.URLError, OSError):
            return False

    def make_trigger(self, context: Context) -> BaseTrigger:
        return HttpTrigger(
            self.url,
            expected_status=self.expected_status,
            poll_interval=max(self.poke_interval, 0.05),
        )


class KafkaMessageOperator(BaseOperator):
    """Wait for a message on ``topic`` (optionally matching ``match``), return its payload."""

    def __init__(
        self,
        *,
        topic: str,
        match: Mapping[str, Any] | None = None,
        key: str | None = None,
        bootstrap_servers: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.topic = topic
        self.match = dict(match) if match is not None else None
        self.key = key
        self.bootstrap_servers = bootstrap_servers
        self.timeout = timeout

    def execute(self, context: Context) -> Any:
        self.defer(
            trigger=KafkaMessageTrigger(
                self.topic,
                self.match,
                key=self.key,
                bootstrap_servers=self.bootstrap_servers,
            ),
            method_name="execute_complete",
            timeout=self.timeout,
        )

    def execute_complete(self, context: Context, event: Any = None) -> Any:
        return event


class FailingOperator(BaseOperator):
    """Always raise (to see failures and retries)."""

    def __init__(self, *, message: str = "this operator always fails", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.message = message

    def execute(self, context: Context) -> Any:
        raise RuntimeError(self.message)


class FlakyOperator(BaseOperator):
    """Fail the first ``fail_tries`` attempts, then succeed (to see retries work)."""

    def __init__(self, *, fail_tries: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_tries = fail_tries

    def execute(self, context: Context) -> Any:
        if context["try_number"] <= self.fail_tries:
            raise RuntimeError(f"try {context['try_number']} fails on purpose")
        return context["try_number"]
