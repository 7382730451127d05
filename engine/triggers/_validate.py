"""Small checks for trigger kwargs: each error names the argument and what was expected."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

__all__ = ["aware_datetime", "boolean", "positive_seconds", "text"]


def aware_datetime(value: Any, name: str) -> dt.datetime:
    """A timezone-aware datetime (or ISO-8601 text with an offset), converted to UTC."""
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError as exc:
            raise ValueError(f"{name}: {value!r} is not an ISO-8601 datetime") from exc
    if not isinstance(value, dt.datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware (naive datetimes are ambiguous)")
    return value.astimezone(dt.UTC)


def positive_seconds(value: Any, name: str) -> float:
    """A finite number of seconds > 0 (a timedelta is accepted too)."""
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    return float(value)


def boolean(value: Any, name: str) -> bool:
    """A real bool (not a truthy string such as "false")."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r}")
    return value


def text(value: Any, name: str, *, optional: bool = False) -> str | None:
    """A non-empty string (or None when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty")
    return value
