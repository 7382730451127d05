"""A standing watch's trigger for tests: an inbox directory, one event per file taken.

``InboxTrigger`` takes the files of ``directory`` in name order, deleting each before it yields
its event (as Airflow's ``FileDeleteTrigger`` does), and goes on within the same run. A file
named ``end-*`` ends the run after its event; one named ``fail-*`` fails the run (taken, no
event). The triggerer starts the watch again after either.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from deferline.engine import BaseTrigger, TriggerEvent

MODULE = __name__
INBOX = f"{MODULE}.InboxTrigger"


def take_next(directory: str) -> str | None:
    """The first file of ``directory`` by name, deleted; None when there is none."""
    for name in sorted(os.listdir(directory)):
        if name.startswith("."):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        return name
    return None


class InboxTrigger(BaseTrigger):
    def __init__(self, directory: str, poll_interval: float = 0.05) -> None:
        super().__init__()
        self.directory = directory
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return INBOX, {"directory": self.directory, "poll_interval": self.poll_interval}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            name = await asyncio.to_thread(take_next, self.directory)
            if name is None:
                await asyncio.sleep(self.poll_interval)
                continue
            if name.startswith("fail-"):
                raise RuntimeError(f"inbox refused {name}")
            yield TriggerEvent({"name": name})
            if name.startswith("end-"):
                return
