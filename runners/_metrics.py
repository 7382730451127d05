"""A Prometheus scrape endpoint served from the process's own event loop.

Any runner can use it: build a :class:`prometheus_client.CollectorRegistry` (one per
process, so tests can run several runners in one interpreter), register its metrics, and
serve it with :class:`MetricsServer`. Collectors run on the event loop thread at scrape
time, so they may read the runner's state without locks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web
from deferline.schemas import DeferlineError
from deferline.topics import Lifecycle
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ._http import serve

__all__ = ["MetricsServer", "MetricsServerError"]

logger = logging.getLogger(__name__)


class MetricsServerError(DeferlineError):
    """The metrics endpoint could not be started."""


class MetricsServer(Lifecycle):
    """Serve ``registry`` at ``http://host:port/metrics`` (port 0 picks a free port), with
    ``/healthz`` (the process answers) and ``/readyz`` (503 while ``unready`` says why).

    Args:
        registry: the registry to expose, or a function giving the registries to expose at
            each scrape (a process whose component is started again in place).
        host: interface to bind; defaults to all interfaces, as Prometheus scrapes remotely.
        port: TCP port; 0 binds an ephemeral port, readable afterwards as :attr:`port`.
        unready: why the process cannot do its work now, or None when it can.
    """

    def __init__(
        self,
        registry: CollectorRegistry | Callable[[], list[CollectorRegistry]],
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        unready: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._registries = registry if callable(registry) else lambda: [registry]
        self._unready = unready
        self._host = host
        self._requested_port = port
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        # ``?name[]=a&name[]=b`` serves only those series, as prometheus_client's own
        # handler does: a poller watching one counter need not render them all.
        names = request.query.getall("name[]", [])
        body = b"".join(
            generate_latest(registry.restricted_registry(names) if names else registry)
            for registry in self._registries()
        )
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _ready(self, request: web.Request) -> web.Response:
        why = self._unready()
        if why is None:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"unready: {why}\n")

    async def start(self) -> None:
        """Bind and start serving."""
        if self._runner is not None:
            return
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/readyz", self._ready)
        try:
            self._runner, self.port = await serve(app, self._host, self._requested_port)
        except OSError as exc:
            raise MetricsServerError(
                f"cannot serve metrics on {self._host}:{self._requested_port}: {exc}"
            ) from exc
        logger.info("metrics served", extra={"host": self._host, "port": self.port})

    async def stop(self) -> None:
        """Stop serving (idempotent)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
