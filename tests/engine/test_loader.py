"""Loading triggers: allowlist by module prefix, class checks, and kwargs errors."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import pytest
from deferline.engine import (
    TriggerImportError,
    TriggerKwargsError,
    TriggerLoadError,
    TriggerNotAllowed,
    is_allowed,
    load_trigger,
)
from deferline.engine.triggers import DateTimeTrigger, FileTrigger, HttpTrigger, TimeDeltaTrigger
from deferline.schemas import DeferlineError, from_tagged, to_tagged

BUILTINS = ["deferline.engine.triggers"]


@pytest.mark.parametrize(
    ("classpath", "prefixes", "allowed"),
    [
        ("a.b.C", ["a.b"], True),
        ("a.b.c.D", ["a.b"], True),
        ("a.bc.D", ["a.b"], False),
        ("a.b.C", ["a.b."], True),
        ("a.b.C", ["a.b.C"], True),
        ("a.b.Cx", ["a.b.C"], False),
        ("x.y.Z", ["a.b", "x"], True),
        ("a.b.C", [], False),
        ("a.b.C", [""], False),
    ],
)
def test_prefix_matches_at_dotted_boundaries(
    classpath: str, prefixes: list[str], allowed: bool
) -> None:
    assert is_allowed(classpath, prefixes) is allowed


def test_error_family() -> None:
    for cls in (TriggerNotAllowed, TriggerImportError, TriggerKwargsError):
        assert issubclass(cls, TriggerLoadError)
        assert issubclass(cls, DeferlineError)


def test_builtins_round_trip_through_the_wire_codec() -> None:
    moment = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    for trigger in (
        DateTimeTrigger(moment),
        TimeDeltaTrigger(dt.timedelta(hours=1)),
        FileTrigger("/data/*.csv", poll_interval=2),
        HttpTrigger("http://127.0.0.1:1/health", json_path="$.ok"),
    ):
        classpath, kwargs = trigger.serialize()
        rebuilt = load_trigger(classpath, from_tagged(to_tagged(kwargs)), allowed_prefixes=BUILTINS)
        assert type(rebuilt).__name__ == type(trigger).__name__ or isinstance(
            trigger, TimeDeltaTrigger
        )
        assert rebuilt.serialize() == trigger.serialize()


def test_not_under_an_allowed_prefix_is_refused_before_import() -> None:
    sys.modules.pop("json.tool", None)
    with pytest.raises(TriggerNotAllowed, match="not under an allowed module prefix") as info:
        load_trigger("json.tool.Anything", {}, allowed_prefixes=BUILTINS)
    assert info.value.classpath == "json.tool.Anything"
    assert "json.tool" not in sys.modules  # never imported
    with pytest.raises(TriggerNotAllowed):
        load_trigger("deferline.engine.triggersx.Evil", {}, allowed_prefixes=BUILTINS)


def test_a_class_cache_keeps_resolved_classes_and_never_a_refusal() -> None:
    classes: dict[str, type] = {}
    moment = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    path = "deferline.engine.triggers.DateTimeTrigger"
    first = load_trigger(path, {"moment": moment}, allowed_prefixes=BUILTINS, classes=classes)
    assert classes == {path: DateTimeTrigger}
    second = load_trigger(path, {"moment": moment}, allowed_prefixes=BUILTINS, classes=classes)
    assert second is not first
    assert second.serialize() == first.serialize()
    for _ in range(2):
        with pytest.raises(TriggerNotAllowed):
            load_trigger("json.tool.Anything", {}, allowed_prefixes=BUILTINS, classes=classes)
    assert list(classes) == [path]
    with pytest.raises(TriggerKwargsError):  # kwargs are still checked with a cached class
        load_trigger(path, {"moment": "soon"}, allowed_prefixes=BUILTINS, classes=classes)


def test_class_must_be_a_base_trigger_subclass() -> None:
    expected = r"not a subclass of deferline\.engine\.BaseTrigger"
    with pytest.raises(TriggerNotAllowed, match=expected):
        load_trigger("os.path.join", {}, allowed_prefixes=["os"])
    with pytest.raises(TriggerNotAllowed, match="not a subclass"):
        load_trigger("deferline.engine.TriggerEvent", {}, allowed_prefixes=["deferline.engine"])


def test_abstract_trigger_is_refused() -> None:
    with pytest.raises(TriggerLoadError, match="abstract"):
        load_trigger("deferline.engine.BaseTrigger", {}, allowed_prefixes=["deferline.engine"])


@pytest.mark.parametrize(
    ("classpath", "message"),
    [
        ("no_dots", "not a dotted"),
        ("bad..path", "not a dotted"),
        ("deferline.engine.triggers.NoSuchTrigger", "has no attribute NoSuchTrigger"),
        ("deferline.engine.triggers.missing_mod.T", "cannot import module"),
    ],
)
def test_import_errors_name_the_cause(classpath: str, message: str) -> None:
    with pytest.raises(TriggerImportError, match=message):
        load_trigger(classpath, {}, allowed_prefixes=["no_dots", "bad", "deferline"])


def test_module_raising_at_import_is_an_import_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "exploding_triggers_mod.py").write_text('raise RuntimeError("config missing")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TriggerImportError, match="RuntimeError: config missing"):
        load_trigger("exploding_triggers_mod.T", {}, allowed_prefixes=["exploding_triggers_mod"])
    sys.modules.pop("exploding_triggers_mod", None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "TypeError"),
        ({"moment": "2030-01-01T00:00:00Z", "bogus": 1}, "unexpected keyword argument 'bogus'"),
        ({"moment": dt.datetime(2030, 1, 1)}, "timezone-aware"),
        ({"moment": 5}, "moment must be a datetime"),
        ({1: "x"}, "not argument names"),
    ],
)
def test_bad_kwargs_are_kwargs_errors(kwargs: dict[object, object], message: str) -> None:
    with pytest.raises(TriggerKwargsError, match=message) as info:
        load_trigger("deferline.engine.triggers.DateTimeTrigger", kwargs, allowed_prefixes=BUILTINS)  # type: ignore[arg-type]
    assert info.value.classpath == "deferline.engine.triggers.DateTimeTrigger"


def test_kwargs_must_be_a_mapping() -> None:
    with pytest.raises(TriggerKwargsError, match="must be a mapping"):
        load_trigger("deferline.engine.triggers.DateTimeTrigger", [1], allowed_prefixes=BUILTINS)  # type: ignore[arg-type]


def test_allowed_prefixes_must_not_be_a_string() -> None:
    with pytest.raises(TypeError):
        load_trigger("deferline.engine.triggers.DateTimeTrigger", {}, allowed_prefixes="deferline")


def test_airflow_classpath_without_airflow_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without apache-airflow installed, an allowed Airflow classpath says what to install."""
    for name in [m for m in sys.modules if m == "airflow" or m.startswith("airflow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "airflow", None)  # imports of airflow.* now fail
    with pytest.raises(TriggerImportError, match=r"pip install 'deferline\[airflow\]'"):
        load_trigger(
            "airflow.triggers.temporal.DateTimeTrigger",
            {"moment": "2030-01-01T00:00:00+00:00"},
            allowed_prefixes=["airflow.triggers"],
        )
