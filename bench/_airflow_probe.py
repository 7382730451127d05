"""A user's Airflow trigger that times what it asks Airflow for, from inside a triggerer.

The same class runs in ``airflow triggerer`` (its supervisor answers) and in a deferline
triggerer (the bridge's Airflow services answer): after ``delay`` seconds it reads the
connection ``conn_id`` ``n`` times (``await BaseHook.aget_connection``, after ``warm_up``) and
the variable ``key`` ``n`` times (``Variable.get``, a sync call inside ``run()``), one at a
time, and writes each round trip in ms as JSON to ``out``. Then it waits for ever.
"""

# mypy: ignore-errors
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook, Variable
from airflow.triggers.base import BaseTrigger, TriggerEvent


class ProbeTrigger(BaseTrigger):
    def __init__(
        self, conn_id: str, key: str, n: int, warm_up: int, delay: float, out: str
    ) -> None:
        super().__init__()
        self.conn_id, self.key, self.n = conn_id, key, n
        self.warm_up, self.delay, self.out = warm_up, delay, out

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.ProbeTrigger", {
            "conn_id": self.conn_id,
            "key": self.key,
            "n": self.n,
            "warm_up": self.warm_up,
            "delay": self.delay,
            "out": self.out,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay)
        took: dict[str, list[float]] = {"GetConnection": [], "GetVariable": []}
        for i in range(self.warm_up + self.n):
            started = time.perf_counter()
            await BaseHook.aget_connection(self.conn_id)
            if i >= self.warm_up:
                took["GetConnection"].append(1000 * (time.perf_counter() - started))
        for i in range(self.warm_up + self.n):
            started = time.perf_counter()
            Variable.get(self.key)
            if i >= self.warm_up:
                took["GetVariable"].append(1000 * (time.perf_counter() - started))
        await asyncio.to_thread(_write, Path(self.out), json.dumps(took))
        self.log.info("probe written to %s", self.out)
        await asyncio.Event().wait()  # for ever
        yield  # an async generator


def _write(path: Path, text: str) -> None:
    """Whole or not at all: the reader polls for the file."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)
