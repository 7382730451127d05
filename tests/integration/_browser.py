"""Test helper: Debian's Chromium, headless, driven over the DevTools protocol (aiohttp websocket).

Nothing is downloaded: the browser is the system's ``chromium`` (apt package ``chromium``). A
missing browser fails the test in CI and skips it elsewhere, with the reason.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import aiohttp

from tests._tools import system_program
from tests._until import until

SCREENSHOTS_ENV = "DEFERLINE_SCREENSHOTS"
"""A directory to keep the screenshots in (default: ``screenshots/`` under the test's tmp)."""


def screenshot_dir(tmp_path: Path) -> Path:
    folder = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Browser:
    """One headless Chromium with one page; every call is a DevTools command."""

    def __init__(self, profile: Path, *, width: int = 1280, height: int = 900) -> None:
        self._profile = profile
        self._size = (width, height)
        self._proc: asyncio.subprocess.Process | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Browser:
        try:
            await self._open()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _open(self) -> None:
        self._profile.mkdir(parents=True, exist_ok=True)
        port_file = self._profile / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)  # a profile used before keeps the old port's file
        self._proc = await asyncio.create_subprocess_exec(
            system_program("chromium", "chromium-browser", package="chromium"),
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--remote-debugging-port=0",
            f"--user-data-dir={self._profile}",
            f"--window-size={self._size[0]},{self._size[1]}",
            "about:blank",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: the browser's children go too
        )

        def port() -> int | None:  # the file appears before its contents
            lines = port_file.read_text().split() if port_file.exists() else []
            return int(lines[0]) if len(lines) >= 2 else None

        devtools = await until(port, within=30, interval=0.05, what="chromium's DevTools port")
        self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{devtools}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = await self._http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.call("Page.enable")

    async def __aexit__(self, *exc: object) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            await asyncio.wait_for(self._proc.wait(), 10)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        ident = next(self._ids)
        await self._ws.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(self._ws.receive(), max(left, 0))
            except TimeoutError:
                raise AssertionError(f"{method}: no answer from the browser in 30 s") from None
            if message.type is not aiohttp.WSMsgType.TEXT:
                raise AssertionError(f"DevTools connection ended: {message.type}")
            data = json.loads(message.data)
            if data.get("id") == ident:
                if "error" in data:
                    raise AssertionError(f"{method}: {data['error']}")
                result: dict[str, Any] = data["result"]
                return result

    async def goto(self, url: str) -> None:
        """Navigate and wait until the document at ``url`` has loaded."""
        await self.call("Page.navigate", url=url)

        async def loaded() -> bool:
            here = await self.evaluate("document.readyState === 'complete' && location.href")
            return bool(here == url)

        await until(loaded, within=30, interval=0.05, what=f"page {url} loaded")

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def text(self, selector: str) -> str:
        """The visible text of the first element matching ``selector`` ('' when none)."""
        value = await self.evaluate(
            f"(document.querySelector({json.dumps(selector)}) || {{}}).innerText || ''"
        )
        return str(value)

    async def texts(self, selector: str) -> list[str]:
        value = await self.evaluate(
            f"[...document.querySelectorAll({json.dumps(selector)})].map(e => e.innerText)"
        )
        return [str(v) for v in value or []]

    async def click(self, selector: str) -> None:
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).click()")

    async def screenshot(self, path: Path) -> Path:
        """Save the whole page as PNG."""
        height = await self.evaluate("document.documentElement.scrollHeight")
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=self._size[0],
            height=max(self._size[1], int(height or 0)),
            deviceScaleFactor=1,
            mobile=False,
        )
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        await self.call("Emulation.clearDeviceMetricsOverride")
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))
        return path
