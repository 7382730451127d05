"""Helpers shared by the engine tests: an outcome sink and small triggers."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

from deferline.engine import BaseTrigger, TriggerEvent, TriggerOutcome


class Sink:
    """Collects outcomes handed to ``on_event``."""

    def __init__(self) -> None:
        self.outcomes: list[TriggerOutcome] = []

    def __call__(self, outcome: TriggerOutcome) -> None:
        self.outcomes.append(outcome)

    def of(self, trigger_id: str) -> list[TriggerOutcome]:
        return [o for o in self.outcomes if o.trigger_id == trigger_id]

    def one(self, trigger_id: str) -> TriggerOutcome:
        found = self.of(trigger_id)
        assert len(found) == 1, found
        return found[0]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class _TestTrigger(BaseTrigger):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {})


class GateTrigger(_TestTrigger):
    """Waits for its gate, then yields ``payload``; records start and cleanup."""

    def __init__(self, payload: Any = "opened", *, log: list[str] | None = None) -> None:
        super().__init__()
        self.payload = payload
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.cleaned = asyncio.Event()
        self.log_ = log

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self.started.set()
        if self.log_ is not None:
            self.log_.append(f"start:{self.payload}")
        await self.gate.wait()
        yield TriggerEvent(self.payload)

    async def cleanup(self) -> None:
        self.cleaned.set()


class RaisingTrigger(_TestTrigger):
    def __init__(self) -> None:
        super().__init__()
        self.cleaned = False
        self.explode = True

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(0)
        if self.explode:
            raise RuntimeError("sensor exploded")
        yield TriggerEvent(None)

    async def cleanup(self) -> None:
        self.cleaned = True


class EmptyTrigger(_TestTrigger):
    produce = False

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(0)
        if self.produce:
            yield TriggerEvent(None)


class MultiTrigger(_TestTrigger):
    """Yields ``count`` events, optionally pausing on a gate before returning."""

    def __init__(
        self, count: int, *, pause_at_end: bool = False, loop_forever: bool = False
    ) -> None:
        super().__init__()
        self.count = count
        self.pause_at_end = pause_at_end
        self.loop_forever = loop_forever
        self.end_gate = asyncio.Event()
        self.closed = False
        self.cleaned = False

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            i = 0
            while self.loop_forever or i < self.count:
                await asyncio.sleep(0)
                yield TriggerEvent({"n": i})
                i += 1
            if self.pause_at_end:
                await self.end_gate.wait()
        finally:
            self.closed = True

    async def cleanup(self) -> None:
        self.cleaned = True


async def first_event(trigger: BaseTrigger) -> TriggerEvent:
    """Iterate ``trigger.run()`` directly to its first event, then close it."""
    agen = trigger.run()
    try:
        return await anext(aiter(agen))
    finally:
        await agen.aclose()  # type: ignore[attr-defined]
