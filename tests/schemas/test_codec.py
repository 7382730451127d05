"""The tagged JSON codec: exact round-trips, plain JSON untouched, clear errors with paths."""

from __future__ import annotations

import datetime as dt
import tracemalloc
import uuid
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import orjson
import pytest
from deferline.schemas import (
    SchemaError,
    canonical_json,
    dumps_kept,
    dumps_value,
    from_tagged,
    loads_value,
    to_tagged,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ._values import aware_datetimes, decimals, hashables, offsets, same, times, values

UTC = dt.UTC


def roundtrip(value: Any) -> Any:
    return loads_value(dumps_value(value))


# -- round-trips -------------------------------------------------------------------------


@settings(deadline=None)
@given(values)
def test_any_supported_value_round_trips_exactly(value: Any) -> None:
    assert same(roundtrip(value), value)
    assert same(from_tagged(to_tagged(value)), value)


@settings(deadline=None)
@given(aware_datetimes)
def test_aware_datetimes_keep_instant_and_offset(value: dt.datetime) -> None:
    back = roundtrip(value)
    assert back == value
    assert back.utcoffset() == value.utcoffset()


@settings(deadline=None)
@given(st.dates())
def test_dates_round_trip(value: dt.date) -> None:
    back = roundtrip(value)
    assert type(back) is dt.date
    assert back == value


@settings(deadline=None)
@given(times)
def test_times_with_and_without_offset_round_trip(value: dt.time) -> None:
    assert same(roundtrip(value), value)


@settings(deadline=None)
@given(st.timedeltas())
def test_timedeltas_round_trip_including_negative(value: dt.timedelta) -> None:
    assert roundtrip(value) == value


def test_negative_timedelta_is_exact() -> None:
    value = -dt.timedelta(days=3, microseconds=1)
    assert to_tagged(value) == {"__type": "timedelta", "__var": [-4, 86399, 999999]}
    assert roundtrip(value) == value


@settings(deadline=None)
@given(decimals)
def test_decimals_round_trip_including_nan_and_infinity(value: Decimal) -> None:
    # NaN != NaN, so compare the exact text: sign, exponent, NaN payloads and sNaN survive.
    back = roundtrip(value)
    assert type(back) is Decimal
    assert str(back) == str(value)


@settings(deadline=None)
@given(st.floats())
def test_floats_round_trip_including_nan_inf_and_negative_zero(value: float) -> None:
    assert same(roundtrip(value), value)


@settings(deadline=None)
@given(st.integers())
def test_integers_of_any_size_round_trip(value: int) -> None:
    assert roundtrip(value) == value


def test_integers_beyond_64_bits_are_tagged_and_others_are_plain() -> None:
    assert to_tagged(2**63 - 1) == 2**63 - 1
    assert to_tagged(-(2**63)) == -(2**63)
    assert to_tagged(2**63) == {"__type": "int", "__var": str(2**63)}


@settings(deadline=None)
@given(st.uuids(), st.binary())
def test_uuid_and_bytes_round_trip(u: uuid.UUID, b: bytes) -> None:
    assert same(roundtrip([u, b, bytearray(b)]), [u, b, b])


@settings(deadline=None)
@given(st.sets(hashables), st.frozensets(hashables))
def test_sets_and_frozensets_keep_their_type(s: set[Any], f: frozenset[Any]) -> None:
    back = roundtrip((s, f))
    assert same(back, (s, f))


def test_tuples_and_lists_stay_distinct() -> None:
    assert same(roundtrip([(1, 2), [1, 2], ((),)]), [(1, 2), [1, 2], ((),)])


def test_dict_with_non_str_keys_round_trips() -> None:
    value = {1: "a", (2, "x"): [3], None: True, uuid.UUID(int=5): dt.date(2024, 1, 2)}
    assert same(roundtrip(value), value)


def test_dict_with_str_subclass_keys_travels_with_plain_str_keys() -> None:
    """HTTP headers (aiohttp's ``istr`` keys) are a str subclass orjson refuses as a key."""

    class Header(str):
        pass

    value = {Header("Content-Type"): "text/plain", "plain": 1}
    assert roundtrip(value) == {"Content-Type": "text/plain", "plain": 1}
    assert {type(k) for k in roundtrip(value)} == {str}
    assert canonical_json(value) == canonical_json({"Content-Type": "text/plain", "plain": 1})


def test_dict_with_a_type_key_is_not_mistaken_for_a_tag() -> None:
    value = {"__type": "datetime", "__var": "2024-01-01T00:00:00+00:00"}
    tagged = to_tagged(value)
    assert tagged["__type"] == "dict"
    assert same(roundtrip(value), value)


def test_nested_containers_round_trip() -> None:
    value = {
        "at": dt.datetime(2030, 5, 1, 12, 30, tzinfo=dt.timezone(dt.timedelta(hours=-7))),
        "rows": [{"id": uuid.UUID(int=1), "amount": Decimal("12.50")}, ("a", b"\x00\xff")],
        "tags": {"x", "y"},
        "window": [dt.time(9, 0), dt.timedelta(hours=2)],
    }
    assert same(roundtrip(value), value)


def test_zoneinfo_datetimes_travel_as_their_offset() -> None:
    value = dt.datetime(2030, 7, 1, 12, 0, tzinfo=ZoneInfo("Europe/Paris"))
    back = roundtrip(value)
    assert back == value
    assert back.utcoffset() == dt.timedelta(hours=2)


@settings(deadline=None)
@given(offsets)
def test_utc_offsets_are_written_as_iso_8601(tz: dt.timezone) -> None:
    value = dt.datetime(2030, 1, 1, tzinfo=tz)
    assert to_tagged(value) == {"__type": "datetime", "__var": value.isoformat()}


# -- plain JSON from other languages ------------------------------------------------------


@settings(deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(), c, max_size=3),
        max_leaves=10,
    ).filter(lambda v: "__type" not in orjson.dumps(v).decode())
)
def test_plain_json_passes_through_unchanged(value: Any) -> None:
    assert to_tagged(value) == value
    assert from_tagged(value) == value


def test_lenient_forms_other_writers_may_use() -> None:
    assert from_tagged({"__type": "datetime", "__var": "2030-01-01T00:00:00Z"}) == dt.datetime(
        2030, 1, 1, tzinfo=UTC
    )
    assert from_tagged({"__type": "datetime", "__var": 0}) == dt.datetime(1970, 1, 1, tzinfo=UTC)
    assert from_tagged({"__type": "timedelta", "__var": 90.5}) == dt.timedelta(seconds=90.5)
    # A JSON number for a decimal keeps its shortest text, not the binary float expansion.
    assert str(from_tagged({"__type": "decimal", "__var": 0.1})) == "0.1"


def test_set_encoding_is_deterministic() -> None:
    assert dumps_value({3, "a", 1, (2, 1)}) == dumps_value({(2, 1), 1, "a", 3})


# -- errors --------------------------------------------------------------------------------


def test_naive_datetime_is_rejected_when_encoding_with_its_path() -> None:
    with pytest.raises(SchemaError, match="naive datetime") as info:
        to_tagged({"rows": [{"at": dt.datetime(2030, 1, 1)}]})
    assert info.value.field == "rows[0].at"


def test_naive_datetime_is_rejected_when_decoding_with_its_path() -> None:
    data = {"when": {"__type": "datetime", "__var": "2030-01-01T00:00:00"}}
    with pytest.raises(SchemaError, match="naive datetime") as info:
        from_tagged(data)
    assert info.value.field == "when"


def test_a_moment_read_again_is_the_one_read_before_and_a_bad_one_still_fails() -> None:
    """A burst's events carry one moment: it is parsed once and the datetime shared."""
    good = {"__type": "datetime", "__var": "2030-01-01T00:00:00.250000+02:00"}
    first, second = from_tagged(good), from_tagged(dict(good))
    assert first == dt.datetime(2030, 1, 1, 0, 0, 0, 250000, dt.timezone(dt.timedelta(hours=2)))
    assert second is first
    with pytest.raises(SchemaError, match="naive datetime"):
        from_tagged({"__type": "datetime", "__var": "2030-01-01T00:00:00"})
    with pytest.raises(SchemaError, match="naive datetime"):  # a failure is not kept either
        from_tagged({"__type": "datetime", "__var": "2030-01-01T00:00:00"})
    assert from_tagged(good) == first
    assert from_tagged({"__type": "datetime", "__var": 1893456000}) == dt.datetime(
        2030, 1, 1, tzinfo=dt.UTC
    ), "epoch seconds are read as before"


def test_unsupported_type_names_the_type_and_path() -> None:
    with pytest.raises(SchemaError, match="cannot encode a value of type object") as info:
        to_tagged({"a": [1, object()]})
    assert info.value.field == "a[1]"


def test_unknown_tag_is_named() -> None:
    with pytest.raises(SchemaError, match="unknown tagged type 'complex'") as info:
        from_tagged({"x": {"y": [{"__type": "complex", "__var": [1, 2]}]}})
    assert info.value.field == "x.y[0]"


def test_tag_with_extra_keys_is_rejected() -> None:
    with pytest.raises(SchemaError, match="exactly the keys") as info:
        from_tagged({"a": {"__type": "uuid", "__var": str(uuid.UUID(int=1)), "x": 1}})
    assert info.value.field == "a"


@pytest.mark.parametrize(
    ("tag", "var"),
    [
        ("datetime", "not a date"),
        ("datetime", [2030, 1, 1]),
        ("date", 20300101),
        ("time", "25:00"),
        ("timedelta", [1, 2]),
        ("timedelta", ["1", 0, 0]),
        ("decimal", "twelve"),
        ("decimal", True),
        ("uuid", 123),
        ("uuid", "not-a-uuid"),
        ("bytes", "***"),
        ("bytes", 5),
        ("float", "many"),
        ("int", "1.5"),
        ("tuple", "abc"),
        ("set", {"a": 1}),
        ("set", [[1]]),
        ("dict", {"ab": 1}),
        ("dict", [[1, 2, 3]]),
        ("datetime", 1e300),
    ],
)
def test_malformed_tagged_values_raise_schema_error_with_path(tag: str, var: Any) -> None:
    with pytest.raises(SchemaError, match=f"bad {tag} value") as info:
        from_tagged({"k": [{"__type": tag, "__var": var}]})
    assert info.value.field == "k[0]"


def test_not_json_is_a_schema_error() -> None:
    with pytest.raises(SchemaError, match="not JSON"):
        loads_value(b"{nope")


def test_deep_nesting_is_a_schema_error_not_a_crash() -> None:
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(SchemaError, match="nested too deeply"):
        to_tagged(deep)
    nested: Any = 1
    for _ in range(900):
        nested = {"a": nested}
    with pytest.raises(SchemaError, match="nested too deeply"):
        from_tagged(nested)
    with pytest.raises(SchemaError):
        loads_value(b"[" * 5000 + b"]" * 5000)


def test_kept_json_is_held_at_its_own_size() -> None:
    row = ("dag", "task", "run", -1, 1, "deferred", {"moment": "2025-01-01T00:00:00Z"})
    assert dumps_kept(row) == orjson.dumps(row)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [dumps_kept((*row, i)) for i in range(1000)]
        per_row = (tracemalloc.get_traced_memory()[0] - before) / len(kept)
    finally:
        tracemalloc.stop()
    assert per_row < 256, f"{per_row:.0f} B per {len(kept[0])}-byte row"
