"""Wait for a file matching a glob pattern; the file system is only touched off the loop."""

from __future__ import annotations

import asyncio
import glob
import os
from collections.abc import AsyncIterator
from typing import Any

from .._trigger import BaseTrigger, TriggerEvent
from ._validate import boolean, positive_seconds, text

__all__ = ["FileTrigger"]


def find_file(pattern: str, recursive: bool) -> str | None:
    """First file matching ``pattern`` (in sorted order), or a file under a matching directory."""
    for path in sorted(glob.glob(pattern, recursive=recursive)):
        if os.path.isfile(path):
            return path
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs.sort()
                if files:
                    return os.path.join(root, min(files))
    return None


class FileTrigger(BaseTrigger):
    """Fire when a file matches ``filepath`` (a glob; ``**`` needs ``recursive=True``).

    A matching directory counts when it contains a file at any depth (as in Airflow).
    Globbing runs in a worker thread every ``poll_interval`` seconds, so a slow or network
    file system never blocks the event loop. Payload: ``{"filepath": pattern, "path":
    the file found}``. ``poke_interval`` is accepted as Airflow's name for the interval.
    """

    def __init__(
        self,
        filepath: str,
        recursive: bool = False,
        poll_interval: float = 5.0,
        *,
        poke_interval: float | None = None,
    ) -> None:
        super().__init__()
        self.filepath: str = text(filepath, "filepath")  # type: ignore[assignment]
        self.recursive = boolean(recursive, "recursive")
        interval = poll_interval if poke_interval is None else poke_interval
        self.poll_interval = positive_seconds(interval, "poll_interval")

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "deferline.engine.triggers.FileTrigger",
            {
                "filepath": self.filepath,
                "recursive": self.recursive,
                "poll_interval": self.poll_interval,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            found = await asyncio.to_thread(find_file, self.filepath, self.recursive)
            if found is not None:
                self.log.debug("found %s for %s", found, self.filepath)
                yield TriggerEvent({"filepath": self.filepath, "path": found})
                return
            await asyncio.sleep(self.poll_interval)
