"""A scripted Airflow services server on a real socket, for the triggerer side's tests.

It speaks the services wire (docs/protocol.md, "Airflow services") with answers the test
scripts, and stands in for ``deferline airflow bridge --services-port``, which
tests/integration/test_airflow*_services* run against Airflow's database.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from deferline.engine import use_airflow_services
from deferline.schemas import KwargsCipher

PATH = "/v1/airflow/requests"


@dataclass
class Services:
    """A scripted services server: variables and connections by key, and a gate requests
    wait at while it is closed."""

    url: str = ""
    variables: dict[str, str] = field(default_factory=dict)
    connections: dict[str, dict[str, Any]] = field(default_factory=dict)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    asked: list[dict[str, Any]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    cipher: KwargsCipher | None = None
    content_types: list[str] = field(default_factory=list)
    counts: dict[str, int | float] = field(default_factory=lambda: {"GetTICount": 2})
    """The count answered to each count request kind."""

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        kind = request["type"]
        if kind == "GetVariable":
            value = self.variables.get(request["key"])
            if value is None:
                return error_frame("VARIABLE_NOT_FOUND", {"key": request["key"]})
            return {"body": {"key": request["key"], "value": value, "type": "VariableResult"}}
        if kind == "GetConnection":
            conn = self.connections.get(request["conn_id"])
            if conn is None:
                return error_frame("CONNECTION_NOT_FOUND", {"conn_id": request["conn_id"]})
            fields = {"schema": None, "login": None, "password": None, "extra": None}
            body = {"conn_id": request["conn_id"], **fields, **conn, "type": "ConnectionResult"}
            return {"body": body}
        if kind in self.counts:
            return {"body": {"count": self.counts[kind], "type": kind.removeprefix("Get")}}
        return error_frame("API_SERVER_ERROR", {"message": f"unexpected {kind}"})

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.content_types.append(request.content_type)
        data = self.cipher.open_bytes(raw) if self.cipher else raw
        asked = orjson.loads(data)["request"]
        self.asked.append(asked)
        self.arrived.set()
        await self.gate.wait()
        body = orjson.dumps({"error": None, **self.answer(asked)})
        if self.cipher:
            return web.Response(
                body=self.cipher.seal_bytes(body), content_type=request.content_type
            )
        return web.Response(body=body, content_type="application/json")


def error_frame(kind: str, detail: dict[str, Any]) -> dict[str, Any]:
    return {"body": None, "error": {"error": kind, "detail": detail, "type": "ErrorResponse"}}


@contextlib.asynccontextmanager
async def listening(
    handle: Callable[[web.Request], Awaitable[web.Response]], port: int = 0
) -> AsyncIterator[str]:
    """Serve ``handle`` at the services path on a real socket; yields the base URL."""
    app = web.Application()
    app.router.add_post(PATH, handle)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{bound}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving(services: Services, port: int = 0) -> AsyncIterator[Services]:
    async with listening(services.handle, port) as url:
        services.url = url
        try:
            yield services
        finally:
            services.gate.set()


@contextlib.contextmanager
def asking(
    urls: list[str], *, timeout: float = 10.0, cipher: KwargsCipher | None = None
) -> Iterator[None]:
    use_airflow_services(urls, timeout=timeout, cipher=cipher)
    try:
        yield
    finally:
        use_airflow_services([])


async def collect(trigger: Any) -> list[Any]:
    """Run ``trigger`` to its end, then clean it up: the events it yielded."""
    events = [event async for event in trigger.run()]
    await trigger.cleanup()
    return events
