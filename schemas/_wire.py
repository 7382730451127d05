"""Bytes in, records out: the one place messages are encoded and decoded."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import ValidationError

from ._errors import SchemaError, UnknownSchemaVersion
from ._models import RECORD_TYPES, SCHEMA_VERSION, WIRE_CONTEXT, AnyRecord, _Record

R = TypeVar("R", bound=_Record)

__all__ = ["decode", "decode_as", "encode"]


def encode(record: _Record) -> bytes:
    """Serialize a record to its wire JSON."""
    return record.__pydantic_serializer__.to_json(record)


def _validate(raw: Any, model: type[R]) -> R:
    try:
        return model.model_validate(raw, context=WIRE_CONTEXT)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        raise SchemaError(f"{first['msg']} ({exc.error_count()} error(s))", field=field) from exc


def _load(data: bytes | str) -> dict[str, Any]:
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise SchemaError(f"expected a JSON object, got {type(raw).__name__}")
    version = raw.get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise UnknownSchemaVersion(
            f"schema version {version!r} is not supported (this build reads {SCHEMA_VERSION})",
            field="version",
        )
    return raw


def decode(data: bytes | str) -> AnyRecord:
    """Parse any deferline record; raises :class:`SchemaError` naming the offending field."""
    raw = _load(data)
    kind = raw.get("kind")
    model = RECORD_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise SchemaError(f"unknown record kind {kind!r}", field="kind")
    return _validate(raw, model)  # type: ignore[return-value]


def decode_as(data: bytes | str, model: type[R]) -> R:
    """Parse a record that must be of one type."""
    raw = _load(data)
    kind = model.model_fields["kind"].default
    if raw.get("kind", kind) != kind:
        raise SchemaError(f"expected kind {kind!r}, got {raw.get('kind')!r}", field="kind")
    return _validate(raw, model)
