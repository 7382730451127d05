"""Bytes in, records out: the one place messages are encoded and decoded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails, PydanticSerializationError

from ._codec import to_tagged
from ._errors import SchemaError, UnknownSchemaVersion
from ._models import RECORD_TYPES, SCHEMA_VERSION, WIRE_CONTEXT, AnyRecord, _Record

R = TypeVar("R", bound=_Record)
F = TypeVar("F")

__all__ = ["decode", "decode_as", "decode_fields", "decode_raw", "encode", "load_raw"]


def _join(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    if part.startswith("["):
        return f"{path}{part}"
    return f"{path}.{part}" if path else part


def _locate(model: BaseModel, path: str = "") -> SchemaError | None:
    """Find which field of a record cannot be encoded (slow path, only after a failure)."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        where = _join(path, name)
        if isinstance(value, BaseModel):
            found = _locate(value, where)
            if found is not None:
                return found
            continue
        try:
            to_tagged(value)
        except SchemaError as exc:
            return SchemaError(exc.reason, field=_join(where, exc.field) if exc.field else where)
    return None


def encode(record: _Record) -> bytes:
    """Serialize a record to its wire JSON; raises :class:`SchemaError` naming the field."""
    try:
        return record.__pydantic_serializer__.to_json(record)
    except PydanticSerializationError as exc:
        found = _locate(record)
        if found is None:
            raise SchemaError(f"cannot encode {type(record).__name__}: {exc}") from exc
        raise found from exc


# Errors whose message already shows the value (or where there is no value to show).
_NO_INPUT = frozenset({"missing", "tagged_value", "tagged_object", "wire_bytes"})


def _describe(error: ErrorDetails, count: int) -> SchemaError:
    field = ""
    for part in error["loc"]:
        field = _join(field, part)
    ctx = error.get("ctx") or {}
    if error["type"] == "tagged_value" and ctx.get("path"):
        field = _join(field, ctx["path"])
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] not in _NO_INPUT:
        shown = repr(error["input"])
        message += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
    if count > 1:
        message += f" (and {count - 1} more error{'s' if count > 2 else ''})"
    return SchemaError(message, field=field or None)


def _validate(raw: dict[str, Any], model: type[R]) -> R:
    try:
        return model.model_validate(raw, context=WIRE_CONTEXT)
    except ValidationError as exc:
        raise _describe(exc.errors()[0], exc.error_count()) from exc


def load_raw(data: bytes | bytearray | memoryview | str) -> dict[str, Any]:
    """The JSON object of a record whose schema version this build reads."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise SchemaError(f"expected a JSON object, got {type(raw).__name__}")
    if "version" not in raw:
        raise SchemaError(
            f"missing; every record names its schema version ({SCHEMA_VERSION})", field="version"
        )
    version = raw["version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise SchemaError(f"must be an integer, got {version!r}", field="version")
    if version != SCHEMA_VERSION:
        raise UnknownSchemaVersion(
            f"schema version {version} is not supported (this build reads {SCHEMA_VERSION})",
            field="version",
        )
    return raw


def _kind(raw: dict[str, Any]) -> str:
    kind = raw.get("kind")
    if kind is None:
        raise SchemaError(f"missing; one of {', '.join(RECORD_TYPES)}", field="kind")
    if not isinstance(kind, str) or kind not in RECORD_TYPES:
        raise SchemaError(
            f"unknown record kind {kind!r} (known: {', '.join(RECORD_TYPES)})", field="kind"
        )
    return kind


def decode(data: bytes | bytearray | memoryview | str) -> AnyRecord:
    """Parse any deferline record; raises :class:`SchemaError` naming the offending field.

    An unknown ``version`` raises :class:`UnknownSchemaVersion` (a ``SchemaError``); unknown
    fields are ignored, so newer writers of the same version stay readable.
    """
    return decode_raw(load_raw(data))


def decode_raw(raw: dict[str, Any]) -> AnyRecord:
    """:func:`decode` of a :func:`load_raw` object."""
    return _validate(raw, RECORD_TYPES[_kind(raw)])  # type: ignore[return-value]


def decode_as(data: bytes | bytearray | memoryview | str, model: type[R]) -> R:
    """Parse a record that must be of one type."""
    raw = load_raw(data)
    kind = _kind(raw)
    expected = model.model_fields["kind"].default
    if kind != expected:
        raise SchemaError(f"expected kind {expected!r}, got {kind!r}", field="kind")
    return _validate(raw, model)


def decode_fields(
    data: bytes | bytearray | memoryview | str,
    kind: str,
    model: type[R],
    quick: Callable[[dict[str, Any]], F | None],
    of: Callable[[R], F],
) -> F | AnyRecord:
    """:func:`decode`, giving a record of ``kind`` (``model``) as its fields: read by ``quick``
    when it takes the record's shape, else validated by the model and read by ``of``."""
    raw = load_raw(data)
    if raw.get("kind") == kind:
        fields = quick(raw)
        if fields is not None:
            return fields
    record = decode_raw(raw)
    if isinstance(record, model):
        return of(record)
    return record
