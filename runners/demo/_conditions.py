"""Helpers that make the demo's conditions come true: files, HTTP answers, Kafka signals."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Container, Sequence
from pathlib import Path

from aiohttp import web
from deferline.topics import Settings, free_port, make_producer, start_client, stop_client

from ._plan import TaskSpec

__all__ = ["ConditionHelpers"]


class ConditionHelpers:
    """Creates files, answers HTTP polls and publishes Kafka signals when their time comes."""

    def __init__(self, *, settings: Settings, topic: str) -> None:
        self.settings = settings
        self.topic = topic
        self.started = time.monotonic()
        self._file_due: list[tuple[float, str]] = []
        self._http_due: dict[str, float] = {}
        self._kafka_due: list[tuple[float, str]] = []
        self.http_requests = 0
        self._runner: web.AppRunner | None = None

    def plan(self, specs: Sequence[TaskSpec]) -> None:
        """The conditions to make true, and when (seconds after :meth:`run` starts)."""
        self._file_due = sorted(
            (s.at or 0.0, str(s.op_kwargs["filepath"])) for s in specs if s.kind == "file"
        )
        self._http_due = {s.name: s.at or 0.0 for s in specs if s.kind == "http"}
        self._kafka_due = sorted((s.at or 0.0, s.name) for s in specs if s.kind == "kafka")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    async def start_http(self) -> str:
        app = web.Application()
        app.router.add_get("/jobs/{name}", self._job)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def stop_http(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _job(self, request: web.Request) -> web.Response:
        self.http_requests += 1
        due = self._http_due.get(request.match_info["name"])
        if due is None:
            return web.Response(status=404, text="no such job\n")
        if self.elapsed() >= due:
            return web.json_response({"status": "done"})
        return web.Response(status=202, text="running\n")

    async def run(self, done: Container[str]) -> None:
        """Create due files and publish due Kafka signals (again until the task is done)."""
        producer = make_producer(self.settings)
        try:
            await start_client(producer, grace=5.0, name="demo signal producer")
            files_next = 0
            while True:
                now = self.elapsed()
                due_files = []
                while files_next < len(self._file_due) and self._file_due[files_next][0] <= now:
                    due_files.append(self._file_due[files_next][1])
                    files_next += 1
                if due_files:
                    await asyncio.to_thread(_touch_all, due_files)
                for at, name in self._kafka_due:
                    if at <= now and name not in done:
                        value = json.dumps({"job": name, "at": round(now, 2)}).encode()
                        await producer.send(self.topic, value=value, key=name.encode())
                await asyncio.sleep(1.0)
        finally:
            await stop_client(producer, grace=5.0, name="demo signal producer")


def _touch_all(paths: Sequence[str]) -> None:
    for path in paths:
        Path(path).write_text("done\n")
