"""The shared Lifecycle base: ``async with`` starts and always stops; a failed start stops;
commands run to the end with their sockets closed."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from deferline.topics import Lifecycle, ThrowawayTLS, run_closing


class Recorder(Lifecycle):
    def __init__(self, *, fail_start: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_start = fail_start

    async def start(self) -> None:
        self.calls.append("start")
        if self.fail_start:
            raise RuntimeError("cannot start")

    async def stop(self) -> None:
        self.calls.append("stop")


async def test_async_with_starts_returns_itself_and_stops() -> None:
    component = Recorder()
    async with component as entered:
        assert entered is component
        assert component.calls == ["start"]
    assert component.calls == ["start", "stop"]


async def test_async_with_stops_when_the_body_raises() -> None:
    component = Recorder()
    with pytest.raises(ValueError, match="body"):
        async with component:
            raise ValueError("body")
    assert component.calls == ["start", "stop"]


async def test_a_failed_start_is_followed_by_stop_and_raises() -> None:
    component = Recorder(fail_start=True)
    with pytest.raises(RuntimeError, match="cannot start"):
        async with component:
            pytest.fail("the body must not run")
    assert component.calls == ["start", "stop"]


async def test_wait_says_when_a_component_has_nothing_to_wait_for() -> None:
    with pytest.raises(NotImplementedError, match="Recorder has nothing to wait for"):
        await Recorder().wait()


def _tls_contexts(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    tls = ThrowawayTLS.create(tmp_path, "127.0.0.1")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tls.keystore_file)
    client = ssl.create_default_context(cafile=str(tls.ca_file))
    return server, client


def test_run_closing_closes_a_tls_connection_closed_without_waiting(tmp_path: Path) -> None:
    """What aiokafka does when a login is refused: close() and raise, nobody awaiting the
    TLS shutdown. A remote peer answers the close_notify a moment later; the socket must be
    closed once the command returns, not left open for the garbage collector."""
    server_ctx, client_ctx = _tls_contexts(tmp_path)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def peer() -> None:  # a broker on another host: its own thread, its own pace
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            while tls.recv(1024):  # until the client's close_notify
                pass
            time.sleep(0.2)
            with contextlib.suppress(OSError):
                tls.unwrap()

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    sockets: list[Any] = []

    async def command() -> str:
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
        sockets.append(writer.transport.get_extra_info("socket"))
        writer.close()  # not awaited
        return "refused"

    try:
        assert run_closing(command()) == "refused"
        [sock] = sockets
        assert sock.fileno() == -1, "the client's socket outlived the command"
    finally:
        thread.join(5)
        listener.close()


def test_run_closing_aborts_what_is_still_open_after_its_grace() -> None:
    sockets: list[Any] = []

    async def command() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        sockets.append(transport.get_extra_info("socket"))
        server.close()  # the connection is left open: a leak the grace cannot wait out

    run_closing(command(), grace=0.05)
    [sock] = sockets
    assert sock.fileno() == -1
