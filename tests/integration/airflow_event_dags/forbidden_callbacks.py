"""A deadline-alert callback outside the allowed prefixes: never imported by deferline."""

from __future__ import annotations

from typing import Any


async def page(to: str, context: dict[str, Any]) -> str:
    raise AssertionError("a callback outside the allowed prefixes ran")
