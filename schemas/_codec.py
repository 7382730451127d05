"""Tagged JSON for values that plain JSON cannot carry (datetimes, decimals, bytes, sets...).

A tagged value is ``{"__type": NAME, "__var": VALUE}``; everything JSON already carries is
left as is, so a worker in any language can write plain JSON kwargs. A dict that itself has a
``"__type"`` key, or non-string keys, is carried as a tagged ``dict`` of pairs.
"""

from __future__ import annotations

import base64
import datetime as dt
import uuid
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson

from ._errors import SchemaError

__all__ = ["dumps_value", "from_tagged", "loads_value", "to_tagged"]

TYPE = "__type"
VAR = "__var"
JsonValue = Any


def _tag(name: str, value: JsonValue) -> dict[str, JsonValue]:
    return {TYPE: name, VAR: value}


def _datetime_to_json(value: dt.datetime) -> JsonValue:
    if value.tzinfo is None or value.utcoffset() is None:
        raise SchemaError("naive datetime; deferline carries only timezone-aware datetimes")
    return _tag("datetime", value.isoformat())


def to_tagged(value: Any, _path: str = "$") -> JsonValue:
    """Turn a Python value into JSON-safe data with tags for the types JSON lacks."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return _tag("float", repr(value))
        return value
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TYPE not in value:
            return {k: to_tagged(v, f"{_path}.{k}") for k, v in value.items()}
        return _tag(
            "dict",
            [[to_tagged(k, f"{_path}[key]"), to_tagged(v, f"{_path}[{k!r}]")] for k, v in value.items()],
        )
    if isinstance(value, list):
        return [to_tagged(v, f"{_path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return _tag("tuple", [to_tagged(v, f"{_path}[{i}]") for i, v in enumerate(value)])
    if isinstance(value, set | frozenset):
        items = [to_tagged(v, f"{_path}[]") for v in value]
        items.sort(key=lambda item: orjson.dumps(item, option=orjson.OPT_SORT_KEYS))
        return _tag("frozenset" if isinstance(value, frozenset) else "set", items)
    try:
        if isinstance(value, dt.datetime):
            return _datetime_to_json(value)
    except SchemaError as exc:
        raise SchemaError(str(exc), field=_path) from None
    if isinstance(value, dt.date):
        return _tag("date", value.isoformat())
    if isinstance(value, dt.time):
        return _tag("time", value.isoformat())
    if isinstance(value, dt.timedelta):
        return _tag("timedelta", [value.days, value.seconds, value.microseconds])
    if isinstance(value, Decimal):
        return _tag("decimal", str(value))
    if isinstance(value, uuid.UUID):
        return _tag("uuid", str(value))
    if isinstance(value, bytes | bytearray):
        return _tag("bytes", base64.b64encode(bytes(value)).decode("ascii"))
    raise SchemaError(f"cannot encode a value of type {type(value).__qualname__}", field=_path)


def _timedelta(var: JsonValue) -> dt.timedelta:
    if isinstance(var, list) and len(var) == 3:
        days, seconds, micros = var
        return dt.timedelta(days=days, seconds=seconds, microseconds=micros)
    return dt.timedelta(seconds=float(var))


def _datetime(var: JsonValue) -> dt.datetime:
    value = dt.datetime.fromisoformat(var) if isinstance(var, str) else dt.datetime.fromtimestamp(
        float(var), dt.UTC
    )
    if value.tzinfo is None:
        raise ValueError("naive datetime; give an offset such as +00:00 or Z")
    return value


_DECODERS: dict[str, Callable[[JsonValue, str], Any]] = {
    "datetime": lambda v, p: _datetime(v),
    "date": lambda v, p: dt.date.fromisoformat(v),
    "time": lambda v, p: dt.time.fromisoformat(v),
    "timedelta": lambda v, p: _timedelta(v),
    "decimal": lambda v, p: Decimal(v),
    "uuid": lambda v, p: uuid.UUID(v),
    "bytes": lambda v, p: base64.b64decode(v, validate=True),
    "float": lambda v, p: float(v),
    "tuple": lambda v, p: tuple(from_tagged(x, f"{p}[{i}]") for i, x in enumerate(v)),
    "set": lambda v, p: {from_tagged(x, f"{p}[]") for x in v},
    "frozenset": lambda v, p: frozenset(from_tagged(x, f"{p}[]") for x in v),
    "dict": lambda v, p: {from_tagged(k, f"{p}[key]"): from_tagged(x, p) for k, x in v},
}


def from_tagged(value: JsonValue, _path: str = "$") -> Any:
    """Inverse of :func:`to_tagged`; raises :class:`SchemaError` naming the field on bad input."""
    if isinstance(value, list):
        return [from_tagged(v, f"{_path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if TYPE not in value:
        return {k: from_tagged(v, f"{_path}.{k}") for k, v in value.items()}
    name = value[TYPE]
    decoder = _DECODERS.get(name) if isinstance(name, str) else None
    if decoder is None or set(value) != {TYPE, VAR}:
        raise SchemaError(f"unknown tagged type {name!r}", field=_path)
    try:
        return decoder(value[VAR], _path)
    except SchemaError:
        raise
    except (ValueError, TypeError, InvalidOperation, ArithmeticError) as exc:
        raise SchemaError(f"bad {name} value {value[VAR]!r}: {exc}", field=_path) from exc


def dumps_value(value: Any) -> bytes:
    """Encode any supported Python value as tagged JSON bytes."""
    return orjson.dumps(to_tagged(value))


def loads_value(data: bytes | str) -> Any:
    """Decode tagged JSON bytes back to Python values."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"not JSON: {exc}") from exc
    return from_tagged(raw)
