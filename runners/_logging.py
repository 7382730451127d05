"""Log output of runner processes: readable text or one JSON object per line.

Lifecycle lines carry structured fields (``trigger_id``, ``task``, ``partition``,
``member``, ...) through ``extra=``; both formats print them, so a line can be grepped by
trigger id in text and filtered by field in JSON.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

import orjson

__all__ = ["configure_logging"]

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys() | {"message", "asctime"}
)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {
        key: value
        for key, value in record.__dict__.items()
        if key not in _STANDARD and value is not None and not key.startswith("_")
    }


class TextFormatter(logging.Formatter):
    """``time level logger message key=value ...``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        if fields:
            line += " " + " ".join(f"{key}={value}" for key, value in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and every extra field."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


def configure_logging(level: str = "INFO", fmt: Literal["text", "json"] = "text") -> None:
    """Send the root logger to stderr in ``fmt`` at ``level`` (replaces earlier handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiokafka is chatty at INFO about every (re)join; keep it to warnings unless debugging.
    if root.level > logging.DEBUG:
        logging.getLogger("aiokafka").setLevel(logging.WARNING)
