"""Operators and a trigger used only by the end-to-end tests (allowed by their Settings)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from deferline.engine import BaseOperator, BaseTrigger, Context, TriggerEvent

MODULE = __name__


class ExplodingTrigger(BaseTrigger):
    """Raises as soon as it runs: a trigger failure."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{MODULE}.ExplodingTrigger", {})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        for _ in ():  # an async generator that raises before its first event
            yield TriggerEvent(None)
        raise RuntimeError("kaboom")


class ExplodeOperator(BaseOperator):
    """Defers on :class:`ExplodingTrigger`; its resume into ``__fail__`` fails the task."""

    def execute(self, context: Context) -> Any:
        self.defer(trigger=ExplodingTrigger(), method_name="execute_complete")

    def execute_complete(self, context: Context, event: Any = None) -> Any:
        raise AssertionError("never resumed normally")


class SleepOperator(BaseOperator):
    """Holds its worker slot for ``seconds`` (new work that competes with resumes)."""

    def __init__(self, *, seconds: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context: Context) -> Any:
        time.sleep(self.seconds)
        return self.seconds
