"""Airflow 3 triggers' runtime requests, answered by a server that holds Airflow's database.

An Airflow 3 trigger asks its triggerer's supervisor for what only Airflow knows (a
connection or variable stored in Airflow's database, XCom, task-instance counts and states,
DAG-run state, human-in-the-loop answers) through ``task_runner.SUPERVISOR_COMMS``.
:class:`RemoteSupervisor` takes that place in a deferline triggerer and sends each request,
over HTTP, to a server that answers it with Airflow's own handlers: ``deferline airflow
bridge --services-port`` (``runners/airflow_bridge/_services.py``). So a triggerer needs no
database credentials, and a trigger gets the data and the errors Airflow's triggerer gives.

The wire (docs/protocol.md, "Airflow services"): ``POST <url>/v1/airflow/requests`` with
``{"request": <the request's model, as JSON>}``; the answer is ``{"body": <the answer's
model> | null, "error": <Airflow's ErrorResponse> | null}``, Airflow's own response frame.
With ``DEFERLINE_KWARGS_KEYS`` set, both are Fernet tokens (``application/fernet``) under
those keys, so answers (passwords among them) cross the network sealed and only a holder of
the keys can ask; a server with keys refuses a request in clear.

Servers are tried in turn, with backoff, until none has answered anything for ``timeout``
(a server working through a backlog is not a silent one); then the trigger gets
:class:`AirflowServicesUnavailable` naming the servers and the limit. Nothing blocks the
event loop: a sync call made inside a trigger's ``async def run()`` (Airflow's own triggers
call ``BaseHook.get_connection`` and ``Variable.get`` so) goes through ``greenback``, as in
Airflow's triggerer; one from another thread waits on the loop's future.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import orjson

from ._errors import AirflowServicesUnavailable

if TYPE_CHECKING:
    import aiohttp
    from deferline.schemas import KwargsCipher

__all__ = [
    "CLEAR_TYPE",
    "READ_KINDS",
    "REQUESTS_PATH",
    "SEALED_TYPE",
    "SEAL_TTL_S",
    "RemoteSupervisor",
    "ServicesClient",
    "SharedReads",
]

logger = logging.getLogger(__name__)

REQUESTS_PATH = "/v1/airflow/requests"
CLEAR_TYPE = "application/json"
SEALED_TYPE = "application/fernet"
SEAL_TTL_S = 60
"""A sealed request older than this is refused (a replayed one)."""
_RETRYABLE_STATUS = frozenset({502, 503, 504})
_FIRST_BACKOFF_S = 0.05
_LONGEST_BACKOFF_S = 1.0
_SILENCE_CHECK_S = 0.25
_LONGEST_WAIT = 10
"""A request behind a backlog waits at most this many times the limit."""


READ_KINDS = frozenset(
    {
        "GetConnection",
        "GetVariable",
        "GetVariableKeys",
        "GetXCom",
        "GetXComCount",
        "GetXComSequenceItem",
        "GetXComSequenceSlice",
        "GetTICount",
        "GetTaskStates",
        "GetPreviousTI",
        "GetDRCount",
        "GetExternalTaskCount",
        "GetDagRunState",
        "GetPreviousDagRun",
        "GetAssetStateStoreByName",
        "GetAssetStateStoreByUri",
        "GetHITLDetailResponse",
    }
)
"""Requests that only read: identical ones in flight at once may share one answer
(:class:`SharedReads`). The others (puts, sets, deletes, a HITL answer) run one by one."""

K = TypeVar("K")
V = TypeVar("V")


class SharedReads(Generic[K, V]):
    """Identical reads at once share one lookup, and every answer is read after its request
    arrived: a request that comes while a lookup of the same key runs waits for the next
    lookup, which starts when that one ends and serves every request that came meanwhile.
    10,000 triggers polling one connection cost a lookup per lookup time, not 10,000.

    Args:
        look_up: reads the answer for one key's request.
    """

    def __init__(self, look_up: Callable[[V], Awaitable[Any]]) -> None:
        self._look_up = look_up
        self._running: set[K] = set()
        self._next: dict[K, tuple[asyncio.Future[Any], V]] = {}
        self.lookups = 0
        """Lookups started (requests answered minus those that shared one)."""

    async def read(self, key: K, request: V) -> Any:
        waiting = self._next.get(key)
        if waiting is None:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            future.add_done_callback(_retrieve)
            self._next[key] = waiting = (future, request)
            if key not in self._running:
                self._start(key)
        return await asyncio.shield(waiting[0])

    def _start(self, key: K) -> None:
        self._running.add(key)
        self.lookups += 1
        asyncio.get_running_loop().create_task(self._run(key))

    async def _run(self, key: K) -> None:
        # Every request that arrived until this lookup begins shares it.
        future, request = self._next.pop(key)
        try:
            future.set_result(await self._look_up(request))
        except Exception as exc:
            future.set_exception(exc)
        finally:
            self._running.discard(key)
            if key in self._next:
                self._start(key)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a shared failure seen, whether or not a reader is still there to see it."""
    if not future.cancelled():
        future.exception()


class ServicesClient:
    """The wire to the services servers, for every Airflow line: one request's JSON in, the
    server's response frame (bytes) out.

    Args:
        urls: base URLs of the servers (``http://bridge:8795``), tried in turn.
        timeout: seconds a request waits while no server answers anything, retries
            included (behind a server's backlog, at most ``_LONGEST_WAIT`` times that).
        cipher: seals requests and opens answers when ``DEFERLINE_KWARGS_KEYS`` is set.
        unavailable: what an unanswered request raises (a subclass of
            :class:`AirflowServicesUnavailable`).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout: float,
        cipher: KwargsCipher | None,
        unavailable: type[AirflowServicesUnavailable] = AirflowServicesUnavailable,
    ) -> None:
        if not urls:
            raise ValueError("at least one Airflow services URL is needed")
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.timeout = timeout
        self.unavailable = unavailable
        self._cipher = cipher
        self._preferred = 0  # the server that answered last
        self._greenback: Any = importlib.import_module("greenback")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._answered_at = -math.inf  # when a server last answered (monotonic)
        self._reads: SharedReads[bytes, tuple[str, bytes, float]] = SharedReads(
            lambda asked: self._ask(*asked)
        )

    def ask_sync(self, kind: str, request: dict[str, Any]) -> bytes:
        """:meth:`ask` for sync code: from the loop's thread through greenback (the loop keeps
        running), from another thread by waiting on the loop."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None:
            if not self._greenback.has_portal():
                raise self.unavailable(
                    f"{kind}: a sync Airflow call (get_connection(), Variable.get(), …) was "
                    "made on the event loop outside a trigger's run(), or with "
                    "AIRFLOW_DISABLE_GREENBACK_PORTAL set; use the async form "
                    "(aget_connection(), …) there"
                )
            answer: bytes = self._greenback.await_(self.ask(kind, request))
            return answer
        loop = self._loop
        if loop is not None and loop.is_running():
            return asyncio.run_coroutine_threadsafe(self.ask(kind, request), loop).result()
        return asyncio.run(self._ask_once_here(kind, request))

    async def ask(self, kind: str, request: dict[str, Any]) -> bytes:
        """The server's response frame to ``request`` (a message of kind ``kind``)."""
        current = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = current
        elif current is not self._loop and self._loop.is_running():
            # A foreign loop (async_to_sync in a thread): ask from the triggerer's loop.
            future = asyncio.run_coroutine_threadsafe(self.ask(kind, request), self._loop)
            return await asyncio.wrap_future(future)
        body, asked_at = orjson.dumps({"request": request}), time.monotonic()
        if kind in READ_KINDS:  # the triggers asking the same at once share one request
            shared: bytes = await self._reads.read(body, (kind, body, asked_at))
            return shared
        return await self._ask(kind, body, asked_at)

    async def _ask_once_here(self, kind: str, request: dict[str, Any]) -> bytes:
        """No loop anywhere (a script): a session for this one request."""
        import aiohttp

        body = orjson.dumps({"request": request})
        async with aiohttp.ClientSession() as session:
            return await self._ask(kind, body, time.monotonic(), session)

    async def ensure_portal(self) -> None:
        """Give the calling task a greenback portal (once per trigger run)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        await self._greenback.ensure_portal()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # The wire ---------------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None),
                connector=aiohttp.TCPConnector(limit=64),
            )
        return self._session

    async def _ask(
        self,
        kind: str,
        body: bytes,
        asked_at: float,
        session: aiohttp.ClientSession | None = None,
    ) -> bytes:
        """POST the request to the servers in turn until one answers it, or until no server
        has answered anything for ``timeout`` (:meth:`_silent_for`)."""
        import aiohttp

        session = session or self._client()
        cipher = self._cipher
        backoff = _FIRST_BACKOFF_S
        index = self._preferred
        last = "no server tried"
        # One silent server must not use the whole limit while another could answer.
        patience = self.timeout if len(self.urls) == 1 else max(self.timeout / 3, 0.1)
        while self._silent_for(asked_at) < self.timeout:
            url = self.urls[index]
            payload, content_type = (
                (cipher.seal_bytes(body), SEALED_TYPE) if cipher else (body, CLEAR_TYPE)
            )
            post = asyncio.ensure_future(self._post(session, url, payload, content_type))
            tried_at = time.monotonic()
            try:
                while not post.done() and self._silent_for(tried_at) < patience:
                    await asyncio.wait({post}, timeout=min(patience, _SILENCE_CHECK_S))
                    if time.monotonic() - asked_at > self.timeout * _LONGEST_WAIT:
                        break
            finally:
                answered = post.done()
                if not answered:  # given up, or the asking trigger cancelled
                    post.cancel()
            if not answered:
                last = f"{url}: no answer within {time.monotonic() - tried_at:.1f} s"
            else:
                try:
                    status, data = post.result()
                except (aiohttp.ClientError, OSError) as exc:
                    status, data = 0, b""
                    last = f"{url}: {type(exc).__name__}: {exc}"
                if status == 200:
                    self._preferred = index
                    self._answered_at = time.monotonic()
                    return cipher.open_bytes(data) if cipher else data
                if status:
                    reason = data[:500].decode("utf-8", "replace").strip()
                    if status not in _RETRYABLE_STATUS:
                        raise self.unavailable(
                            f"{kind}: {url} refused the request (HTTP {status}): {reason}"
                        )
                    last = f"{url}: HTTP {status} {reason}"
            if time.monotonic() - asked_at > self.timeout * _LONGEST_WAIT:
                break
            index = (index + 1) % len(self.urls)
            await asyncio.sleep(min(backoff, max(self.timeout - self._silent_for(asked_at), 0)))
            backoff = min(backoff * 2, _LONGEST_BACKOFF_S)
        raise self.unavailable(
            f"{kind}: no Airflow services server answered within {self.timeout:g} s "
            f"(DEFERLINE_AIRFLOW_SERVICES_TIMEOUT; servers: {', '.join(self.urls)}); "
            f"last: {last}"
        )

    def _silent_for(self, since: float) -> float:
        """Seconds since ``since`` or since a server last answered, whichever is later: a
        bridge working through a backlog (answering others) is not silent, so a request
        queued behind thousands waits its turn, where one that hangs or is gone is given up
        after ``timeout`` (and any after ``timeout`` times ``_LONGEST_WAIT``)."""
        return time.monotonic() - max(since, self._answered_at)

    async def _post(
        self, session: aiohttp.ClientSession, url: str, payload: bytes, content_type: str
    ) -> tuple[int, bytes]:
        async with session.post(
            url + REQUESTS_PATH, data=payload, headers={"Content-Type": content_type}
        ) as response:
            return response.status, await response.read()


class RemoteSupervisor:
    """Airflow 3's ``task_runner.SUPERVISOR_COMMS`` in a deferline triggerer: each request
    sent to the services servers, each answer read as Airflow's triggerer channel reads it.

    Args: as :class:`ServicesClient`'s.
    """

    def __init__(self, urls: Sequence[str], *, timeout: float, cipher: KwargsCipher | None) -> None:
        comms: Any = importlib.import_module("airflow.sdk.execution_time.comms")
        runner: Any = importlib.import_module("airflow.jobs.triggerer_job_runner")
        self._decoder: Any = importlib.import_module("pydantic").TypeAdapter(runner.ToTriggerRunner)
        self._error_model: Any = comms.ErrorResponse
        exceptions: Any = importlib.import_module("airflow.sdk.exceptions")
        self._runtime_error: Any = exceptions.AirflowRuntimeError
        # Airflow's secrets lookup takes any other error of its channel for "not here" and
        # tries the next backend, ending in "not defined": a lookup that could not be asked
        # would fail its trigger with a wrong reason. Its authoritative-deny error is the one
        # it lets through, so the unanswered request is raised as both.
        unavailable: type[AirflowServicesUnavailable] = type(
            "AirflowServicesUnavailable",
            (AirflowServicesUnavailable, exceptions.AirflowSecretsBackendAccessDenied),
            {"__module__": AirflowServicesUnavailable.__module__},
        )
        self.client = ServicesClient(urls, timeout=timeout, cipher=cipher, unavailable=unavailable)

    def send(self, msg: Any) -> Any:
        """Ask synchronously (:meth:`ServicesClient.ask_sync`)."""
        if type(msg).__name__ == "MaskSecret":
            return None
        kind = type(msg).__name__
        return self._answer(kind, self.client.ask_sync(kind, msg.model_dump(mode="json")))

    async def asend(self, msg: Any) -> Any:
        """Ask, and return Airflow's answer model (or raise Airflow's error, as its
        triggerer's channel does)."""
        if type(msg).__name__ == "MaskSecret":
            return None
        kind = type(msg).__name__
        return self._answer(kind, await self.client.ask(kind, msg.model_dump(mode="json")))

    def _answer(self, kind: str, data: bytes) -> Any:
        """Airflow's response frame to what its channel returns: the model, or its error
        raised (``CommsDecoder._from_frame``)."""
        try:
            frame = orjson.loads(data)
            error = frame.get("error")
            if error is not None:
                error = self._error_model.model_validate(error)
            body = frame.get("body")
            answer = None if body is None else self._decoder.validate_python(body)
        except (ValueError, AttributeError) as exc:  # pydantic's ValidationError is one
            # Airflow's lookups would take this for "not found": say what it is instead.
            raise self.client.unavailable(
                f"{kind}: the Airflow services' answer is not one this Airflow reads (are the "
                f"bridge and the triggerer on the same Airflow version?): {exc}"
            ) from None
        if error is not None:
            raise self._runtime_error(error=error)
        return answer
