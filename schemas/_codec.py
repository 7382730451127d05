"""Tagged JSON for values that plain JSON cannot carry (datetimes, decimals, bytes, sets...).

A tagged value is ``{"__type": NAME, "__var": VALUE}``; everything JSON already carries is
left as is, so a worker in any language can write plain JSON kwargs. A dict that itself has a
``"__type"`` key, or non-string keys, is carried as a tagged ``dict`` of ``[key, value]`` pairs.
The tags are listed in ``docs/protocol.md``.

Errors name the offending value by a relative path such as ``moment`` or ``items[2].at``.
"""

from __future__ import annotations

import base64
import datetime as dt
import math
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any, Final, Generic, TypeVar

import orjson

from ._errors import SchemaError

__all__ = [
    "LastRead",
    "MomentTagger",
    "dumps_kept",
    "dumps_record",
    "dumps_value",
    "from_tagged",
    "loads_value",
    "to_tagged",
    "whole_minute_offset",
]

_Read = TypeVar("_Read")

TYPE = "__type"
VAR = "__var"
JsonValue = Any
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_SORT = orjson.OPT_SORT_KEYS


def _tag(name: str, value: JsonValue) -> dict[str, JsonValue]:
    return {TYPE: name, VAR: value}


def _key(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _sorted_json(items: list[JsonValue]) -> list[JsonValue]:
    items.sort(key=lambda item: orjson.dumps(item, option=_SORT))
    return items


def _encode(value: Any, path: str, canonical: bool) -> JsonValue:
    # Ordered by frequency in trigger kwargs; bool before int is implied (bool is returned as is).
    if value is None or isinstance(value, str | bool):
        return value
    if type(value) is dt.datetime and value.utcoffset() is not None:
        return _tag("datetime", value.isoformat())  # a fired timer's payload: the hot path
    if isinstance(value, int):
        return value if _INT64_MIN <= value <= _INT64_MAX else _tag("int", str(value))
    if isinstance(value, float):
        return value if math.isfinite(value) else _tag("float", repr(value))
    if isinstance(value, dict):
        if TYPE not in value and all(isinstance(k, str) for k in value):
            # str(k): a str subclass key (HTTP headers' istr) as the plain str JSON needs.
            return {str(k): _encode(v, _key(path, k), canonical) for k, v in value.items()}
        pairs = [
            [_encode(k, f"{path}[key {k!r}]", canonical), _encode(v, f"{path}[{k!r}]", canonical)]
            for k, v in value.items()
        ]
        return _tag("dict", _sorted_json(pairs) if canonical else pairs)
    if isinstance(value, list):
        return [_encode(v, f"{path}[{i}]", canonical) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return _tag("tuple", [_encode(v, f"{path}[{i}]", canonical) for i, v in enumerate(value)])
    if isinstance(value, set | frozenset):
        items = _sorted_json([_encode(v, f"{path}[]", canonical) for v in value])
        return _tag("frozenset" if isinstance(value, frozenset) else "set", items)
    if isinstance(value, dt.datetime):
        if value.utcoffset() is None:
            raise SchemaError(
                "naive datetime; deferline carries only timezone-aware datetimes "
                "(use datetime.now(timezone.utc) or attach a tzinfo)",
                field=path or None,
            )
        return _tag("datetime", value.isoformat())
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
    if isinstance(value, bytes | bytearray | memoryview):
        return _tag("bytes", base64.b64encode(value).decode("ascii"))
    raise SchemaError(
        f"cannot encode a value of type {type(value).__qualname__}; kwargs, payloads and xcoms "
        "may hold JSON values, datetime, date, time, timedelta, Decimal, UUID, bytes, tuple, "
        "set and frozenset",
        field=path or None,
    )


def to_tagged(value: Any) -> JsonValue:
    """Turn a Python value into JSON-safe data with tags for the types JSON lacks."""
    try:
        return _encode(value, "", False)
    except RecursionError:
        raise SchemaError("value is nested too deeply to encode") from None


class MomentTagger:
    """:func:`to_tagged` that keeps the last datetime it tagged with its tagged form: the
    events of a burst of timers carry one moment, tagged again for every event otherwise.
    The form returned is shared: read it, never change it."""

    __slots__ = ("_moment", "_tagged")

    def __init__(self) -> None:
        self._moment: dt.datetime | None = None
        self._tagged: JsonValue = None

    def __call__(self, value: Any) -> JsonValue:
        if type(value) is not dt.datetime:
            return to_tagged(value)
        last = self._moment
        # Equal instants in other zones are equal datetimes: the zone must be the same too.
        if last is None or value != last or value.tzinfo is not last.tzinfo:
            self._moment, self._tagged = value, to_tagged(value)
        return self._tagged


def canonical_json(value: Any) -> bytes:
    """Tagged JSON with sorted keys and pairs: equal values give equal bytes (for ids)."""
    try:
        return orjson.dumps(_encode(value, "", True), option=_SORT)
    except RecursionError:
        raise SchemaError("value is nested too deeply to encode") from None
    except orjson.JSONEncodeError as exc:
        raise SchemaError(f"cannot encode value: {exc}") from exc


# -- decoding ------------------------------------------------------------------------------


def _want(var: JsonValue, what: str, *kinds: type) -> None:
    if not isinstance(var, kinds) or isinstance(var, bool):
        raise TypeError(f"expected {what}, got {type(var).__name__}")


class LastRead(Generic[_Read]):
    """A parse that keeps its last input and result, given back for an equal input: the
    events of a burst of timers carry one moment, read again for every event otherwise. For
    parses of plain values whose results are immutable (they are shared); a parse that
    raises keeps nothing."""

    __slots__ = ("_last", "_parse")

    def __init__(self, parse: Callable[[Any], _Read]) -> None:
        self._parse = parse
        self._last: tuple[Any, _Read] | None = None

    def __call__(self, text: Any) -> _Read:
        last = self._last  # one tuple, read and replaced whole
        if last is not None and text == last[0]:
            return last[1]
        value = self._parse(text)
        self._last = (text, value)
        return value


def _moment(text: str) -> dt.datetime:
    value = dt.datetime.fromisoformat(text)
    if value.utcoffset() is None:
        raise ValueError("naive datetime; give an offset such as +00:00 or Z")
    return value


_read_moment: Final = LastRead(_moment)


def _datetime(var: JsonValue, path: str) -> dt.datetime:
    if isinstance(var, int | float) and not isinstance(var, bool):
        return dt.datetime.fromtimestamp(var, dt.UTC)
    _want(var, "an ISO 8601 string or epoch seconds", str)
    return _read_moment(var)


def _date(var: JsonValue, path: str) -> dt.date:
    _want(var, "an ISO 8601 date string", str)
    return dt.date.fromisoformat(var)


def _time(var: JsonValue, path: str) -> dt.time:
    _want(var, "an ISO 8601 time string", str)
    return dt.time.fromisoformat(var)


def _timedelta(var: JsonValue, path: str) -> dt.timedelta:
    if isinstance(var, list):
        if len(var) != 3:
            raise ValueError("expected [days, seconds, microseconds]")
        for part in var:
            _want(part, "integers in [days, seconds, microseconds]", int)
        return dt.timedelta(days=var[0], seconds=var[1], microseconds=var[2])
    _want(var, "[days, seconds, microseconds] or a number of seconds", int, float)
    return dt.timedelta(seconds=var)


def _decimal(var: JsonValue, path: str) -> Decimal:
    _want(var, "a decimal string", str, int, float)
    # A JSON number goes through its shortest repr, so 0.1 stays 0.1 rather than 0.1000...0555.
    return Decimal(var if isinstance(var, str) else repr(var))


def _uuid(var: JsonValue, path: str) -> uuid.UUID:
    _want(var, "a UUID string", str)
    return uuid.UUID(var)


def _bytes(var: JsonValue, path: str) -> bytes:
    _want(var, "a base64 string", str)
    return base64.b64decode(var, validate=True)


def _float(var: JsonValue, path: str) -> float:
    _want(var, '"nan", "inf" or "-inf"', str, int, float)
    return float(var)


def _int(var: JsonValue, path: str) -> int:
    _want(var, "a string of decimal digits", str, int)
    return int(var)


def _items(var: JsonValue, path: str) -> list[Any]:
    _want(var, "an array", list)
    return [_decode(x, f"{path}[{i}]") for i, x in enumerate(var)]


def _set(var: JsonValue, path: str) -> set[Any]:
    return set(_items(var, path))


def _dict(var: JsonValue, path: str) -> dict[Any, Any]:
    _want(var, "an array of [key, value] pairs", list)
    out: dict[Any, Any] = {}
    for i, pair in enumerate(var):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"item {i} is not a [key, value] pair")
        key = _decode(pair[0], f"{path}[key {i}]")
        out[key] = _decode(pair[1], f"{path}[{key!r}]")
    return out


_DECODERS: dict[str, Callable[[JsonValue, str], Any]] = {
    "datetime": _datetime,
    "date": _date,
    "time": _time,
    "timedelta": _timedelta,
    "decimal": _decimal,
    "uuid": _uuid,
    "bytes": _bytes,
    "float": _float,
    "int": _int,
    "tuple": lambda v, p: tuple(_items(v, p)),
    "set": _set,
    "frozenset": lambda v, p: frozenset(_items(v, p)),
    "dict": _dict,
}
TAGS = tuple(_DECODERS)


def _decode(value: JsonValue, path: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if TYPE not in value:
        return {k: _decode(v, _key(path, k)) for k, v in value.items()}
    name = value[TYPE]
    if set(value) != {TYPE, VAR}:
        raise SchemaError(
            f"a tagged value has exactly the keys {TYPE!r} and {VAR!r}, got {sorted(value)}",
            field=path or None,
        )
    decoder = _DECODERS.get(name) if isinstance(name, str) else None
    if decoder is None:
        raise SchemaError(
            f"unknown tagged type {name!r} (known: {', '.join(TAGS)})", field=path or None
        )
    try:
        return decoder(value[VAR], path)
    except SchemaError:
        raise
    except (ValueError, TypeError, ArithmeticError, OSError) as exc:
        shown = repr(value[VAR])
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise SchemaError(f"bad {name} value {shown}: {exc}", field=path or None) from exc


class _Unread(Exception):
    """:func:`_quick` met a value it leaves to :func:`_decode` (which names what is wrong)."""


def _quick(value: JsonValue) -> Any:
    # _decode without the field paths, which only its error messages use: on anything that
    # is not read plainly, from_tagged starts again with _decode.
    if isinstance(value, dict):
        if TYPE not in value:
            return {k: _quick(v) for k, v in value.items()}
        name = value[TYPE]
        decoder = _DECODERS.get(name) if isinstance(name, str) else None
        if decoder is None or len(value) != 2 or VAR not in value:
            raise _Unread
        try:
            return decoder(value[VAR], "")
        except (SchemaError, ValueError, TypeError, ArithmeticError, OSError):
            raise _Unread from None
    if isinstance(value, list):
        return [_quick(v) for v in value]
    return value


def from_tagged(value: JsonValue) -> Any:
    """Inverse of :func:`to_tagged`; raises :class:`SchemaError` naming the field on bad input."""
    try:
        try:
            return _quick(value)
        except _Unread:
            return _decode(value, "")
    except RecursionError:
        raise SchemaError("value is nested too deeply to decode") from None


def dumps_kept(value: Any) -> bytes:
    """``orjson.dumps(value)`` in a bytes object of its own size, for JSON kept in memory.

    orjson hands back its whole working buffer (about 4 KB) as the bytes object, however
    short the JSON: a hundred thousand checkpoint rows or events waiting for their acks held
    400 MB where they needed 40. The copy costs a fraction of a microsecond.
    """
    return memoryview(orjson.dumps(value)).tobytes()


def whole_minute_offset(moment: dt.datetime) -> bool:
    """True when ``moment``'s UTC offset is whole minutes: orjson then writes it as the wire
    models do (it rounds an offset with seconds where pydantic-core writes them)."""
    if moment.tzinfo is dt.UTC and type(moment) is dt.datetime:  # "Z" read back: the usual case
        return True
    offset = moment.utcoffset()
    return offset is not None and not offset.seconds % 60 and not offset.microseconds


def dumps_record(fields: dict[str, Any]) -> bytes:
    """A record's wire JSON from its fields in the model's order (tagged values tagged,
    datetimes with :func:`whole_minute_offset`): the bytes the model's encoder gives, UTC as
    ``Z``, in an object of its own size (see :func:`dumps_kept`).

    Raises ``orjson.JSONEncodeError`` where the model's encoder may still succeed or name
    the field: callers fall back to the model then."""
    return memoryview(orjson.dumps(fields, option=orjson.OPT_UTC_Z)).tobytes()


def dumps_value(value: Any) -> bytes:
    """Encode any supported Python value as tagged JSON bytes."""
    tagged = to_tagged(value)
    try:
        return orjson.dumps(tagged)
    except orjson.JSONEncodeError as exc:
        raise SchemaError(f"cannot encode value: {exc}") from exc


def loads_value(data: bytes | str) -> Any:
    """Decode tagged JSON bytes back to Python values."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"not JSON: {exc}") from exc
    return from_tagged(raw)
