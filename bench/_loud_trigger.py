"""The loud trigger of bench_trigger_log_load: logs ``rate`` lines a second for ``seconds``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from deferline.engine import BaseTrigger, TriggerEvent

LOUD = f"{__name__}.LoudTrigger"
_TICK = 0.01


class LoudTrigger(BaseTrigger):
    """Logs ``rate`` warning lines a second (a burst every 10 ms, catching up if it falls
    behind), then fires with how many it logged."""

    def __init__(self, rate: float, seconds: float) -> None:
        super().__init__()
        self.rate = rate
        self.seconds = seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return LOUD, {"rate": self.rate, "seconds": self.seconds}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        log = self.log
        start = time.monotonic()
        logged = 0
        while (elapsed := time.monotonic() - start) < self.seconds:
            due = int(elapsed * self.rate)
            while logged < due:
                log.warning("line %d of a loud trigger, password=%s", logged, "not-a-secret")
                logged += 1
            await asyncio.sleep(_TICK)
        yield TriggerEvent({"logged": logged})
