"""Deadline-alert callbacks the deployment allows (``DEFERLINE_ALLOWED_TRIGGER_PREFIXES``)."""

from __future__ import annotations

from typing import Any


async def page(to: str, context: dict[str, Any]) -> str:
    return f"paged {to} for {context['dag_run']['dag_run_id']}"
