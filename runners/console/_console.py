"""`deferline console`: a web page over the topics, live by server-sent events.

One process, nothing else to run: a tail of every deferline topic (the loop's figures, dead
letters, failures), the consumer groups described every few seconds (members, partitions,
lags, what moved), and replay sessions for the stuck list and a task's page. The page is
plain HTML, CSS and JavaScript served from the package; it gets a JSON snapshot twice a second
over ``/api/stream``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hmac
import json
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from aiohttp import web
from deferline.replay import REPORT_CSS, BadSubject, GroupHints, read_live_view
from deferline.schemas import DeferlineError, KwargsCipher
from deferline.topics import Lifecycle, Settings

from ._feed import RecordFeed
from ._groups import GroupTracker
from ._inspect import Inspector
from ._loop import LoopSummary
from ._status import ConsoleStatus
from ._tail import TopicTail

__all__ = ["Console", "ConsoleOptions"]

logger = logging.getLogger(__name__)

_STATIC = ("index.html", "console.js", "console.css")
_TYPES = {"html": "text/html", "js": "text/javascript", "css": "text/css"}


@dataclass(frozen=True, slots=True)
class ConsoleOptions:
    """How the console serves and refreshes.

    Args:
        host: interface to bind (default loopback: put a proxy with authentication in front
            to share it).
        port: TCP port; 0 picks a free one, readable afterwards as :attr:`Console.port`.
        tick_s: seconds between two snapshots pushed to the page.
        groups_every_s: seconds between two descriptions of the consumer groups.
        stuck_every_s: seconds between two refreshes of the stuck list (each is a replay read).
        stuck_older_than: a task waiting on a trigger this long is stuck.
        stuck_limit: the stuck list explains at most this many (the oldest).
        redrive_token: when set, the task page offers a re-drive button, and a re-drive must
            carry this token (``Authorization: Bearer <token>``); None: read-only.
        hints: the group names of the deployment (default: from the topic prefix).
    """

    host: str = "127.0.0.1"
    port: int = 8780
    tick_s: float = 0.5
    groups_every_s: float = 2.0
    stuck_every_s: float = 10.0
    stuck_older_than: dt.timedelta = dt.timedelta(minutes=10)
    stuck_limit: int = 100
    redrive_token: str | None = None
    hints: GroupHints | None = field(default=None)


def _rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


class Console(Lifecycle):
    """The console's web server and the readers behind it."""

    def __init__(self, settings: Settings, options: ConsoleOptions | None = None) -> None:
        self._settings = settings
        self._options = options = options or ConsoleOptions()
        self._hints = options.hints or GroupHints.for_prefix(settings.topic_prefix)
        self.status = ConsoleStatus(settings)
        self.feed = RecordFeed()
        self._tail = TopicTail(settings, self.feed, self.status)
        self._tracker = GroupTracker()
        cipher = KwargsCipher(settings.kwargs_keys) if settings.kwargs_keys else None
        self._inspector = Inspector(
            settings,
            hints=self._hints,
            cipher=cipher,
            older_than=options.stuck_older_than,
            limit=options.stuck_limit,
        )
        self._summary: LoopSummary | None = None
        self._groups: list[dict[str, Any]] = []
        self._groups_error: str | None = None
        self._stuck_error: str | None = None
        self._snapshot: dict[str, Any] = {}
        self._ticked = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._loops: asyncio.Task[None] | None = None
        self.port: int | None = None

    async def start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/report.css", self._report_css)
        app.router.add_get("/api/snapshot", self._snapshot_json)
        app.router.add_get("/api/stream", self._stream)
        app.router.add_get("/api/task", self._task)
        app.router.add_post("/api/redrive", self._redrive)
        self._runner = runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=1.0
        )
        await runner.setup()
        site = web.TCPSite(runner, self._options.host, self._options.port)
        try:
            await site.start()
        except OSError as exc:
            raise DeferlineError(
                f"cannot serve the console on {self._options.host}:{self._options.port}: {exc}"
            ) from exc
        sockets = getattr(site._server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self._options.port
        self._snapshot = self._build()
        self._loops = asyncio.create_task(self._run_loops(), name="deferline-console")
        logger.info("console served", extra={"host": self._options.host, "port": self.port})

    async def stop(self) -> None:
        loops, self._loops = self._loops, None
        if loops is not None:
            loops.cancel()
            try:
                await loops
            except asyncio.CancelledError:
                if not loops.cancelled():
                    raise
        self._ticked.set()  # wake the streams so they see the end
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def wait(self) -> None:
        if self._loops is not None:
            await self._loops

    async def _run_loops(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._tail.run())
            group.create_task(self._every(self._options.tick_s, self._tick))
            group.create_task(self._every(self._options.groups_every_s, self._refresh_groups))
            group.create_task(self._every(self._options.stuck_every_s, self._refresh_stuck))

    @staticmethod
    async def _every(seconds: float, step: Callable[[], Awaitable[None]]) -> None:
        while True:
            await step()
            await asyncio.sleep(seconds)

    async def _tick(self) -> None:
        self._summary = self.feed.loop.sample(time.time())
        self._snapshot = self._build()
        ticked, self._ticked = self._ticked, asyncio.Event()
        ticked.set()

    async def _refresh_groups(self) -> None:
        topics = [info for info, _ in self._tail.topics.values()]
        if not topics or not self.status.ok:
            return
        try:
            live = await read_live_view(
                self._settings,
                topics=topics,
                end_offsets=dict(self._tail.end_offsets),
                partitions={name: range(n) for name, (_, n) in self._tail.topics.items()},
                hints=self._hints,
            )
        except Exception as exc:  # shown on the groups view, tried again next time
            self._groups_error = self.status.explain(exc)[1]
            return
        self._groups = self._tracker.observe(live, time.time())
        self._groups_error = "; ".join(live.errors) or None

    async def _refresh_stuck(self) -> None:
        if not self._tail.topics or not self.status.ok:
            return
        try:
            waiting = self.feed.waiting.waiting(
                now=dt.datetime.now(dt.UTC), older_than=self._options.stuck_older_than
            )
            await self._inspector.refresh_stuck(waiting, self.feed.failed)
        except Exception as exc:  # shown on the stuck view, tried again next time
            self._stuck_error = self.status.explain(exc)[1]
        else:
            self._stuck_error = None

    def _build(self) -> dict[str, Any]:
        return {
            "taken_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "cluster": {
                "bootstrap_servers": self._settings.bootstrap_servers,
                "prefix": self._settings.topic_prefix,
            },
            "status": self.status.to_json(),
            "overview": self._summary.to_json() if self._summary else None,
            "groups": self._groups,
            "groups_error": self._groups_error,
            "stuck": self._inspector.stuck,
            "stuck_error": self._stuck_error,
            "dead": list(self.feed.dead)[:100],
            "redrive": self._options.redrive_token is not None,
            "console": {
                "records_read": self.feed.records,
                "tasks_known": len(self.feed.loop),
                "fetched_bytes": self._tail.fetch_bytes,
                "max_rss_mib": _rss_mib(),
            },
        }

    def snapshot(self) -> dict[str, Any]:
        """The latest snapshot the page shows."""
        return self._snapshot

    async def _index(self, request: web.Request) -> web.Response:
        return self._file("index.html")

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in _STATIC:
            raise web.HTTPNotFound()
        return self._file(name)

    @staticmethod
    def _file(name: str) -> web.Response:
        body = resources.files(__package__).joinpath("static", name).read_bytes()
        kind = _TYPES[name.rpartition(".")[2]]
        return web.Response(body=body, content_type=kind, charset="utf-8")

    async def _report_css(self, request: web.Request) -> web.Response:
        return web.Response(text=REPORT_CSS, content_type="text/css")

    async def _snapshot_json(self, request: web.Request) -> web.Response:
        return web.json_response(self._snapshot)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        while self._loops is not None:
            payload = json.dumps(self._snapshot, separators=(",", ":"))
            await response.write(f"data: {payload}\n\n".encode())
            await self._ticked.wait()
        return response

    async def _task(self, request: web.Request) -> web.Response:
        subject = request.query.get("subject", "")
        try:
            page = await self._inspector.task_page(subject)
        except BadSubject as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except Exception as exc:  # the page says what the cluster answered
            return web.json_response({"error": self.status.explain(exc)[1]}, status=502)
        page["redrive"] = self._options.redrive_token is not None
        return web.json_response(page)

    async def _redrive(self, request: web.Request) -> web.Response:
        token = self._options.redrive_token
        if token is None:
            return web.json_response(
                {"error": "this console is read-only (start it with --allow-redrive)"},
                status=403,
            )
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            return web.json_response({"error": "a re-drive needs the console's token"}, status=401)
        body = await request.json()
        trigger_id = body.get("trigger_id") if isinstance(body, dict) else None
        if not isinstance(trigger_id, str) or not trigger_id:
            return web.json_response({"error": "no trigger_id given"}, status=400)
        try:
            plan = await self._inspector.redrive(trigger_id)
        except Exception as exc:  # the page says what the cluster answered
            return web.json_response({"error": self.status.explain(exc)[1]}, status=502)
        logger.info(
            "re-drive from the console",
            extra={"trigger_id": trigger_id, "action": plan["action"], "reason": plan["reason"]},
        )
        return web.json_response(plan)
