"""What the console can say about its connection to the cluster: one explicit state.

CONNECTING → CATCHING_UP → LIVE, and from any of them to REFUSED (the principal was not
allowed), UNREACHABLE (no broker answered), EMPTY (no deferline topic under the prefix) or
FAILED (anything else), each with a message for the page; from those back to CONNECTING on
the next attempt.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from deferline.replay import TopicsNotFound
from deferline.topics import AccessError, Settings, access_error, principal_of
from deferline.topics._clients import is_bootstrap_failure

from .._transitions import checked

__all__ = ["ConsoleState", "ConsoleStatus"]


class ConsoleState(StrEnum):
    CONNECTING = "connecting"
    CATCHING_UP = "catching_up"
    LIVE = "live"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"
    EMPTY = "empty"
    FAILED = "failed"


_TROUBLE = frozenset(
    {ConsoleState.REFUSED, ConsoleState.UNREACHABLE, ConsoleState.EMPTY, ConsoleState.FAILED}
)
_MOVES: dict[ConsoleState, frozenset[ConsoleState]] = {
    ConsoleState.CONNECTING: frozenset({ConsoleState.CATCHING_UP, *_TROUBLE}),
    ConsoleState.CATCHING_UP: frozenset({ConsoleState.LIVE, *_TROUBLE}),
    ConsoleState.LIVE: frozenset(_TROUBLE),
    **{state: frozenset({ConsoleState.CONNECTING, state}) for state in _TROUBLE},
}


class ConsoleStatus:
    """The tail's state and the message the page shows for it."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.state = ConsoleState.CONNECTING
        self.message = f"connecting to {settings.bootstrap_servers}"
        self.progress: float | None = None

    def move(self, state: ConsoleState, message: str) -> None:
        if state is not self.state:
            checked("console status", _MOVES, self.state, state)
        self.state, self.message = state, message
        if state is not ConsoleState.CATCHING_UP:
            self.progress = None

    def fail(self, exc: BaseException) -> None:
        """Name what went wrong in the words an operator can act on."""
        self.move(*self.explain(exc))

    def explain(self, exc: BaseException) -> tuple[ConsoleState, str]:
        servers = self._settings.bootstrap_servers
        prefix = self._settings.topic_prefix
        if isinstance(exc, TopicsNotFound):
            return ConsoleState.EMPTY, (
                f"The cluster at {servers} has no deferline topics under the prefix "
                f"{prefix!r}: nothing has run here yet (create them with `deferline topics "
                "create`), or the prefix is not the deployment's (--topic-prefix)."
            )
        mapped = (
            exc
            if isinstance(exc, AccessError)
            else access_error(exc, principal=principal_of(self._settings))
        )
        if mapped is not None:
            return ConsoleState.REFUSED, (
                f"The brokers refused this console: {type(mapped).__name__}: {mapped} "
                "(the console needs the replay role's ACLs: see docs/operations.md)."
            )
        if is_bootstrap_failure(exc):
            return ConsoleState.UNREACHABLE, (
                f"No broker answered at {servers}: {type(exc).__name__}: {exc}. "
                "Retrying; the figures below are from before it went away."
            )
        return ConsoleState.FAILED, f"Reading the cluster failed: {type(exc).__name__}: {exc}"

    @property
    def ok(self) -> bool:
        return self.state not in _TROUBLE

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "ok": self.ok,
            "message": self.message,
            "progress": self.progress,
        }
