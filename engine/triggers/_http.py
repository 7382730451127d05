"""Poll an HTTP endpoint until its response matches (status, body text, JSON value)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import orjson

from .._trigger import BaseTrigger, TriggerEvent
from ._validate import positive_seconds, text

__all__ = ["HttpTrigger", "parse_json_path", "resolve_json_path"]

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_MAX_BODY = 1 << 20  # read at most 1 MiB of a response
_BODY_IN_PAYLOAD = 1000  # characters of the body carried in the event
_TOKEN = re.compile(r"\.([^.\[\]]+)|\[(-?\d+)\]|\[\"([^\"]*)\"\]")
_MISSING = object()


def parse_json_path(path: str) -> tuple[str | int, ...]:
    """Parse ``$.a.b[0]["c d"]`` (the ``$`` and first dot are optional) into path steps."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError("json_path must be a non-empty string such as '$.status'")
    rest = path.strip()
    if rest.startswith("$"):
        rest = rest[1:]
    if rest and rest[0] not in ".[":
        rest = "." + rest
    steps: list[str | int] = []
    pos = 0
    while pos < len(rest):
        m = _TOKEN.match(rest, pos)
        if m is None:
            raise ValueError(f"json_path {path!r}: cannot parse at {rest[pos:]!r}")
        name, index, quoted = m.groups()
        steps.append(int(index) if index is not None else (name if quoted is None else quoted))
        pos = m.end()
    if not steps:
        raise ValueError(f"json_path {path!r} selects nothing")
    return tuple(steps)


def resolve_json_path(document: Any, steps: tuple[str | int, ...]) -> Any:
    """The value at ``steps`` in ``document``, or a private marker when it is absent."""
    value = document
    for step in steps:
        if isinstance(value, dict):
            key = step if isinstance(step, str) else str(step)
            if key not in value:
                return _MISSING
            value = value[key]
        elif isinstance(value, list):
            try:
                value = value[int(step)]
            except (ValueError, IndexError):
                return _MISSING
        else:
            return _MISSING
    return value


def _statuses(value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, list | tuple) else [value]
    if not items:
        raise ValueError("expected_status must name at least one status")
    out: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not 100 <= item <= 599:
            raise ValueError(f"expected_status: {item!r} is not an HTTP status (100-599)")
        out.append(item)
    return tuple(out)


class HttpTrigger(BaseTrigger):
    """Poll ``url`` every ``poll_interval`` seconds until the response matches.

    A response matches when its status is one of ``expected_status`` and, if given, its
    body contains ``body_contains`` and the JSON value at ``json_path`` exists and is not
    null (and equals ``json_value`` when that is given). Connection errors and
    non-matching responses are retried; bound the wait with the deferral's timeout.

    ``headers`` may carry credentials: trigger kwargs are encrypted at rest when a key is
    configured. ``data`` is sent as the request body (a dict or list as JSON).
    Payload: ``{"url", "status", "body"}`` (the body cut to 1,000 characters), plus
    ``"value"`` when ``json_path`` is set.
    """

    def __init__(
        self,
        url: str,
        method: str = "GET",
        expected_status: int | list[int] = 200,
        body_contains: str | None = None,
        json_path: str | None = None,
        poll_interval: float = 30.0,
        headers: Mapping[str, str] | None = None,
        *,
        json_value: Any = None,
        data: str | dict[str, Any] | list[Any] | None = None,
        request_timeout: float = 30.0,
    ) -> None:
        super().__init__()
        self.url: str = text(url, "url")  # type: ignore[assignment]
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"url must be an absolute http(s) URL, got {url!r}")
        method = text(method, "method")  # type: ignore[assignment]
        assert method is not None
        if method.upper() not in _METHODS:
            raise ValueError(f"method must be one of {', '.join(sorted(_METHODS))}")
        self.method = method.upper()
        self.expected_status = _statuses(expected_status)
        self.body_contains = text(body_contains, "body_contains", optional=True)
        self.json_path = json_path
        self._steps = None if json_path is None else parse_json_path(json_path)
        if json_value is not None and json_path is None:
            raise ValueError("json_value needs json_path")
        self.json_value = json_value
        self.poll_interval = positive_seconds(poll_interval, "poll_interval")
        if headers is not None and (
            not isinstance(headers, Mapping)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
        ):
            raise TypeError("headers must be a mapping of strings to strings")
        self.headers = dict(headers) if headers else None
        if data is not None and not isinstance(data, str | dict | list):
            raise TypeError("data must be a string, or a dict/list sent as JSON")
        self.data = data
        self.request_timeout = positive_seconds(request_timeout, "request_timeout")

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "deferline.engine.triggers.HttpTrigger",
            {
                "url": self.url,
                "method": self.method,
                "expected_status": list(self.expected_status),
                "body_contains": self.body_contains,
                "json_path": self.json_path,
                "poll_interval": self.poll_interval,
                "headers": self.headers,
                "json_value": self.json_value,
                "data": self.data,
                "request_timeout": self.request_timeout,
            },
        )

    def match(self, status: int, body: bytes) -> dict[str, Any] | None:
        """The event payload if this response matches, else None."""
        if status not in self.expected_status:
            return None
        body_text = body.decode("utf-8", errors="replace")
        if self.body_contains is not None and self.body_contains not in body_text:
            return None
        payload: dict[str, Any] = {
            "url": self.url,
            "status": status,
            "body": body_text[:_BODY_IN_PAYLOAD],
        }
        if self._steps is not None:
            try:
                document = orjson.loads(body)
            except orjson.JSONDecodeError:
                return None
            value = resolve_json_path(document, self._steps)
            if value is _MISSING or value is None:
                return None
            if self.json_value is not None and value != self.json_value:
                return None
            payload["value"] = value
        return payload

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        body: dict[str, Any] = {}
        if isinstance(self.data, str):
            body["data"] = self.data
        elif self.data is not None:
            body["data"] = orjson.dumps(self.data)
            body["headers"] = {"Content-Type": "application/json", **(self.headers or {})}
        headers = body.pop("headers", self.headers)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            attempt = 0
            while True:
                attempt += 1
                try:
                    async with session.request(
                        self.method, self.url, headers=headers, **body
                    ) as response:
                        content = await response.content.read(_MAX_BODY)
                        payload = self.match(response.status, content)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self.log.debug(
                        "%s %s failed (attempt %d): %r", self.method, self.url, attempt, exc
                    )
                    payload = None
                else:
                    if payload is None:
                        self.log.debug(
                            "%s %s: status %d does not match yet (attempt %d)",
                            self.method,
                            self.url,
                            response.status,
                            attempt,
                        )
                if payload is not None:
                    yield TriggerEvent(payload)
                    return
                await asyncio.sleep(self.poll_interval)
