"""HttpTrigger against a local aiohttp server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from deferline.engine import TriggerEvent, TriggerSupervisor
from deferline.engine.triggers import HttpTrigger
from deferline.engine.triggers.testing import parse_json_path, resolve_json_path

from tests._until import until

from ._support import Sink


@dataclass
class Server:
    url: str
    responses: list[tuple[int, str]]
    requests: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    """Serves ``responses`` in order (the last one repeats) and records each request."""
    state = Server(url="", responses=[(200, "ok")])

    async def handle(request: web.Request) -> web.Response:
        state.requests.append(
            {
                "method": request.method,
                "headers": dict(request.headers),
                "body": await request.text(),
            }
        )
        status, body = state.responses.pop(0) if len(state.responses) > 1 else state.responses[0]
        return web.Response(status=status, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.url = f"http://127.0.0.1:{port}/job/7"
    try:
        yield state
    finally:
        await runner.cleanup()


async def _first_event(trigger: HttpTrigger) -> TriggerEvent:
    agen = trigger.run()
    try:
        return await asyncio.wait_for(anext(aiter(agen)), 10)
    finally:
        await agen.aclose()  # type: ignore[attr-defined]


async def test_fires_on_expected_status(server: Server) -> None:
    server.responses = [(503, "busy"), (503, "busy"), (200, '{"state": "done"}')]
    event = await _first_event(HttpTrigger(server.url, poll_interval=0.001))
    assert event.payload == {"url": server.url, "status": 200, "body": '{"state": "done"}'}
    assert len(server.requests) == 3


async def test_expected_status_list_and_body_contains(server: Server) -> None:
    server.responses = [(202, "queued"), (202, "still queued"), (202, "FINISHED ok")]
    trigger = HttpTrigger(
        server.url, expected_status=[200, 202], body_contains="FINISHED", poll_interval=0.001
    )
    event = await _first_event(trigger)
    assert event.payload["status"] == 202
    assert event.payload["body"] == "FINISHED ok"


async def test_json_path_and_value(server: Server) -> None:
    server.responses = [
        (200, "not json"),
        (200, '{"job": {"runs": [{"state": "running"}]}}'),
        (200, '{"job": {"runs": [{"state": null}]}}'),
        (200, '{"job": {"runs": [{"state": "success"}]}}'),
    ]
    trigger = HttpTrigger(
        server.url, json_path="$.job.runs[0].state", json_value="success", poll_interval=0.001
    )
    event = await _first_event(trigger)
    assert event.payload["value"] == "success"
    assert len(server.requests) == 4


async def test_json_path_exists(server: Server) -> None:
    server.responses = [(200, '{"a": 1}'), (200, '{"result": {"rows": 0}}')]
    event = await _first_event(HttpTrigger(server.url, json_path="result", poll_interval=0.001))
    assert event.payload["value"] == {"rows": 0}


async def test_method_headers_and_json_body_are_sent(server: Server) -> None:
    trigger = HttpTrigger(
        server.url,
        method="post",
        headers={"Authorization": "Bearer s3cret"},
        data={"query": "status"},
        poll_interval=0.001,
    )
    await _first_event(trigger)
    request = server.requests[0]
    assert request["method"] == "POST"
    assert request["headers"]["Authorization"] == "Bearer s3cret"
    assert request["headers"]["Content-Type"] == "application/json"
    assert request["body"] == '{"query":"status"}'


async def test_connection_errors_are_retried(caplog: pytest.LogCaptureFixture) -> None:
    # Reserve a port, close it, poll it (refused), then start a server there.
    caplog.set_level(logging.DEBUG, logger="deferline.engine.triggers._http")
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    task = asyncio.create_task(
        _first_event(HttpTrigger(f"http://127.0.0.1:{port}/", poll_interval=0.01))
    )

    def failures() -> int:
        return sum("failed (attempt" in r.getMessage() for r in caplog.records)

    await until(lambda: failures() >= 2)
    assert not task.done()

    async def up(request: web.Request) -> web.Response:
        return web.Response(text="up")

    app = web.Application()
    app.router.add_get("/", up)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        event = await asyncio.wait_for(task, 10)
    finally:
        await runner.cleanup()
    assert event.payload["body"] == "up"


async def test_runs_under_the_supervisor_and_cancels_cleanly(server: Server) -> None:
    server.responses = [(404, "nope")]
    sink = Sink()
    async with TriggerSupervisor(capacity=2, on_event=sink) as sup:
        sup.add("http", HttpTrigger(server.url, poll_interval=0.001))
        await until(lambda: len(server.requests) >= 2)
        assert await sup.cancel("http")
        count = len(server.requests)
        server.responses = [(200, "late")]
        await asyncio.sleep(0.02)  # would poll several times if still running
        assert len(server.requests) == count
        assert sink.outcomes == []


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"url": "ftp://x/y"}, ValueError, "absolute http"),
        ({"url": "/relative"}, ValueError, "absolute http"),
        ({"url": "http://x", "method": "BREW"}, ValueError, "method must be one of"),
        ({"url": "http://x", "expected_status": 99}, ValueError, "not an HTTP status"),
        ({"url": "http://x", "expected_status": []}, ValueError, "at least one"),
        ({"url": "http://x", "poll_interval": -1}, ValueError, "poll_interval"),
        ({"url": "http://x", "headers": {"a": 1}}, TypeError, "headers"),
        ({"url": "http://x", "json_value": 3}, ValueError, "json_value needs json_path"),
        ({"url": "http://x", "json_path": "a..b"}, ValueError, "cannot parse"),
        ({"url": "http://x", "data": 3}, TypeError, "data must be"),
    ],
)
def test_validation(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        HttpTrigger(**kwargs)


def test_serialize_round_trips() -> None:
    trigger = HttpTrigger("https://api.example/x", json_path="$.ok", json_value=True)
    classpath, kwargs = trigger.serialize()
    assert classpath == "deferline.engine.triggers.HttpTrigger"
    assert HttpTrigger(**kwargs).serialize() == (classpath, kwargs)


def test_json_path() -> None:
    assert parse_json_path("$.a.b[2]") == ("a", "b", 2)
    assert parse_json_path('a["odd key"].c') == ("a", "odd key", "c")
    assert parse_json_path("$[0]") == (0,)
    doc = {"a": {"b": [10, 20, 30]}, "odd key": 1}
    assert resolve_json_path(doc, ("a", "b", 2)) == 30
    assert resolve_json_path(doc, ("a", "b", -1)) == 30
    assert resolve_json_path(doc, ("a", "b", 5)) is not None  # missing marker, not an error
    assert resolve_json_path(doc, ("a", "x")) is resolve_json_path(doc, ("zzz",))
    with pytest.raises(ValueError, match="selects nothing"):
        parse_json_path("$")
