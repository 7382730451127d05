"""The bridge's Airflow services: deferline triggerers' Airflow triggers ask, Airflow answers.

``deferline airflow bridge --services-port`` serves ``POST /v1/airflow/requests``, the wire
of ``deferline.engine``'s ``ServicesClient`` (docs/protocol.md, "Airflow services"): one
runtime request of an Airflow trigger in, Airflow's response frame out, answered by
:class:`~._airflow_requests.AirflowRequests` (Airflow 3) or
:class:`~._airflow2_requests.Airflow2Requests` (Airflow 2.10) in worker threads (one on
SQLite, whose writers take turns anyway) so the bridge's loop never waits on the database.
With ``DEFERLINE_KWARGS_KEYS`` set, requests must come sealed with those keys (and fresh: at
most ``SEAL_TTL_S`` old) and answers go back sealed; a request in clear is refused. Requests
and answers are never logged: they carry passwords.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import orjson
from aiohttp import web
from deferline.engine._airflow_services import (
    CLEAR_TYPE,
    READ_KINDS,
    REQUESTS_PATH,
    SEAL_TTL_S,
    SEALED_TYPE,
    SharedReads,
)
from deferline.schemas import DecryptionError, DeferlineError, KwargsCipher
from deferline.topics import Lifecycle

from .._http import serve
from ._airflow2_requests import Airflow2Requests
from ._airflow_requests import AirflowRequests, RequestRefused
from ._metrics import BridgeMetrics

__all__ = ["AirflowServices", "AirflowServicesError", "Requests", "requests_for_this_airflow"]

logger = logging.getLogger(__name__)

_MAX_REQUEST_BYTES = 1 << 20


class AirflowServicesError(DeferlineError):
    """The services endpoint could not be started."""


class Requests(Protocol):
    """What answers the requests: :class:`AirflowRequests` (Airflow 3) or
    :class:`Airflow2Requests` (Airflow 2.10)."""

    @property
    def team_name(self) -> str | None: ...

    @property
    def kinds(self) -> frozenset[str]: ...

    def answer(self, request: Any) -> dict[str, Any]: ...

    def warm_up(self) -> None: ...


def requests_for_this_airflow(team_name: str | None) -> Requests:
    """The answerer for the installed Airflow's triggers."""
    if importlib.util.find_spec("airflow.sdk") is not None:  # Airflow 3
        return AirflowRequests(team_name=team_name)
    return Airflow2Requests(team_name=team_name)


class AirflowServices(Lifecycle):
    """Serve Airflow triggers' runtime requests at ``http://host:port/v1/airflow/requests``.

    Args:
        requests: answers each request from Airflow's database.
        metrics: counts requests by kind and outcome, and times them.
        cipher: ``DEFERLINE_KWARGS_KEYS``; when set, only sealed requests are answered.
        threads: requests answered at once (each on its own database session).
        host, port: where to listen; port 0 binds an ephemeral port (:attr:`port`).
    """

    def __init__(
        self,
        requests: Requests,
        *,
        metrics: BridgeMetrics,
        cipher: KwargsCipher | None,
        threads: int,
        host: str = "0.0.0.0",
        port: int = 0,
    ) -> None:
        self._requests = requests
        self._metrics = metrics
        self._cipher = cipher
        self._threads = threads
        self._host = host
        self._requested_port = port
        self._pool: ThreadPoolExecutor | None = None
        self._runner: web.AppRunner | None = None
        self._reads: SharedReads[bytes, Any] = SharedReads(self._look_up)
        self.port: int | None = None

    async def start(self) -> None:
        if self._runner is not None:
            return
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="airflow-services")
        # Building Airflow's in-process API takes seconds: done before the bridge claims a row,
        # so that its triggers' first requests do not wait behind it (and time out).
        await asyncio.get_running_loop().run_in_executor(self._pool, self._requests.warm_up)
        app = web.Application(client_max_size=_MAX_REQUEST_BYTES)
        app.router.add_post(REQUESTS_PATH, self._serve)
        try:
            self._runner, self.port = await serve(app, self._host, self._requested_port)
        except OSError as exc:
            raise AirflowServicesError(
                f"cannot serve Airflow services on {self._host}:{self._requested_port}: {exc}"
            ) from exc
        logger.info(
            "Airflow services serving",
            extra={
                "services_port": self.port,
                "sealed": self._cipher is not None,
                "threads": self._threads,
                "team": self._requests.team_name,
            },
        )

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def _serve(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        sealed = request.content_type == SEALED_TYPE
        kind = "unknown"
        try:
            message = self._open(await request.read(), sealed)
            if isinstance(message, dict) and message.get("type") in self._requests.kinds:
                kind = message["type"]
            try:
                if kind in READ_KINDS:  # identical reads at once: one lookup
                    key = orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
                    frame = await self._reads.read(key, message)
                else:
                    frame = await self._look_up(message)
            except RequestRefused as exc:
                raise _Refusal(400, str(exc)) from None
        except _Refusal as refusal:
            self._metrics.count_request(kind, "refused", time.perf_counter() - started)
            logger.warning(
                "Airflow services request refused: %s",
                refusal.reason,
                extra={"kind": kind, "peer": request.remote},
            )
            return web.Response(status=refusal.status, text=refusal.reason)
        outcome = "error" if frame["error"] is not None else "answered"
        self._metrics.count_request(kind, outcome, time.perf_counter() - started)
        body = orjson.dumps(frame)
        if sealed and self._cipher is not None:
            return web.Response(body=self._cipher.seal_bytes(body), content_type=SEALED_TYPE)
        return web.Response(body=body, content_type=CLEAR_TYPE)

    def _open(self, raw: bytes, sealed: bool) -> Any:
        """The request's message, or the :class:`_Refusal` saying why there is none."""
        cipher = self._cipher
        if cipher is not None and not sealed:
            raise _Refusal(
                401,
                "this bridge answers only requests sealed with DEFERLINE_KWARGS_KEYS: "
                "give the triggerer the same keys",
            )
        if sealed and cipher is None:
            raise _Refusal(400, "a sealed request, and no DEFERLINE_KWARGS_KEYS here")
        try:
            data = cipher.open_bytes(raw, ttl=SEAL_TTL_S) if cipher is not None else raw
        except DecryptionError as exc:
            raise _Refusal(401, f"request not opened: {exc}") from None
        try:
            return orjson.loads(data)["request"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise _Refusal(400, 'not {"request": {...}} JSON') from None

    async def _look_up(self, message: Any) -> dict[str, Any]:
        assert self._pool is not None
        kind = message.get("type") if isinstance(message, dict) else None
        self._metrics.count_lookup(kind if kind in self._requests.kinds else "unknown")
        loop = asyncio.get_running_loop()
        frame: dict[str, Any] = await loop.run_in_executor(
            self._pool, self._requests.answer, message
        )
        return frame


class _Refusal(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
