"""The standing watch of bench_watches: a trigger that yields ``n`` events as fast as it can."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from deferline.engine import BaseTrigger, TriggerEvent

BURST = f"{__name__}.BurstWatch"


class BurstWatch(BaseTrigger):
    """Yields ``{"i": 0}`` … ``{"i": n - 1}``, giving the loop back every 100 events."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return BURST, {"n": self.n}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        for i in range(self.n):
            yield TriggerEvent({"i": i})
            if not i % 100:
                await asyncio.sleep(0)
