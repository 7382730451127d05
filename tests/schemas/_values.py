"""Hypothesis strategies for codec values and a strict, type-aware equality."""

from __future__ import annotations

import datetime as dt
import math
import uuid
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st

# Fixed offsets, including odd ones with seconds (ISO 8601 allows +HH:MM:SS).
offsets = st.one_of(
    st.integers(-23 * 60 - 59, 23 * 60 + 59).map(lambda m: dt.timedelta(minutes=m)),
    st.integers(-86399, 86399).map(lambda s: dt.timedelta(seconds=s)),
).map(dt.timezone)

aware_datetimes = st.datetimes(timezones=offsets)
times = st.times(timezones=st.none() | offsets)
decimals = st.decimals(allow_nan=True, allow_infinity=True)

hashable_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.uuids(),
    st.dates(),
    aware_datetimes,
    st.timedeltas(),
    st.decimals(allow_nan=False),
)
hashables = st.one_of(hashable_scalars, st.tuples(hashable_scalars, hashable_scalars))

scalars = st.one_of(
    hashable_scalars,
    st.floats(),  # nan, inf, -inf, -0.0
    decimals,
    times,
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=6), children, max_size=4),
        st.dictionaries(hashables, children, max_size=4),
        st.builds(
            lambda d, v: {**d, "__type": v},
            st.dictionaries(st.text(max_size=6), children, max_size=3),
            children,
        ),
        st.sets(hashables, max_size=4),
        st.frozensets(hashables, max_size=4),
    )


values = st.recursive(scalars, _containers, max_leaves=20)
kwargs_dicts = st.dictionaries(st.text(min_size=1, max_size=10), values, max_size=5)


def _typed_key(value: Any) -> Any:
    # ISO text for datetimes: ``fold`` means nothing once the offset is written out.
    if isinstance(value, tuple):
        return "tuple", tuple(map(_typed_key, value))
    if isinstance(value, dt.datetime | dt.time):
        return type(value).__name__, value.isoformat()
    return type(value).__name__, repr(value)


def same(a: Any, b: Any) -> bool:
    """Equal in value *and* type, all the way down; NaN equals NaN; datetimes keep offsets."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, Decimal):
        return str(a) == str(b)
    if isinstance(a, dt.datetime | dt.time):
        return bool(a.isoformat() == b.isoformat() and a.utcoffset() == b.utcoffset())
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        if len(a) != len(b):
            return False
        keys_b = {k: k for k in b}
        return all(k in keys_b and same(k, keys_b[k]) and same(v, b[k]) for k, v in a.items())
    if isinstance(a, set | frozenset):
        return sorted(map(repr, map(_typed_key, a))) == sorted(map(repr, map(_typed_key, b)))
    if isinstance(a, str | bytes | int | bool | dt.date | dt.timedelta | uuid.UUID | None):
        return bool(a == b)
    raise AssertionError(f"no comparison for {type(a)}")
