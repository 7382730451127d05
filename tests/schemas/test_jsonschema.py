"""The committed JSON Schemas are what the models produce, and records validate against them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from deferline.schemas import RECORD_TYPES, SCHEMA_VERSION, encode, rendered_json_schemas
from deferline.schemas.export import main, write_json_schemas
from deferline.schemas.testing import Record

from ._examples import DOCS, RECORDS, doc_block

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = DOCS / "schemas"
RUN = "the committed JSON Schemas are out of date: run `make schemas` and commit docs/schemas/"


def committed(kind: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMAS / f"{kind}.json").read_text("utf-8"))
    return loaded


def test_committed_files_equal_what_the_models_produce() -> None:
    wanted = rendered_json_schemas()
    present = sorted(p.name for p in SCHEMAS.glob("*.json"))
    assert present == sorted(wanted), RUN
    for name, text in wanted.items():
        assert (SCHEMAS / name).read_text("utf-8") == text, f"{name}: {RUN}"


def test_output_is_deterministic_with_sorted_keys_and_final_newline() -> None:
    first, second = rendered_json_schemas(), rendered_json_schemas()
    assert first == second
    for text in first.values():
        assert text.endswith("}\n")
        assert (
            json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            == text
        )


@pytest.mark.parametrize("kind", sorted(RECORD_TYPES))
def test_each_schema_is_valid_and_identified(kind: str) -> None:
    schema = committed(kind)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$id"] == f"urn:deferline:schema:{kind}:v{SCHEMA_VERSION}"
    assert schema["title"] == RECORD_TYPES[kind].__name__
    assert schema["version"] == SCHEMA_VERSION
    assert schema["required"][:2] == ["kind", "version"]
    assert schema["properties"]["kind"]["const"] == kind


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_encoded_records_validate_against_their_schema(record: Record) -> None:
    kind = type(record).model_fields["kind"].default
    validator = jsonschema.Draft202012Validator(committed(kind))
    validator.validate(orjson.loads(encode(record)))


def test_the_protocol_doc_example_validates() -> None:
    validator = jsonschema.Draft202012Validator(committed("defer_request"))
    validator.validate(json.loads(doc_block("kcat-example", "json")))


@pytest.mark.parametrize(
    ("change", "drop"),
    [
        ({"version": 2}, None),
        ({"kind": "cancel_request"}, None),
        ({}, "kind"),
        ({}, "version"),
        ({"task": {"dag_id": "a b", "task_id": "t", "run_id": "r"}}, None),
        ({"defer_seq": -1}, None),
    ],
)
def test_schema_rejects_what_decode_rejects(change: dict[str, Any], drop: str | None) -> None:
    instance = {**json.loads(doc_block("kcat-example", "json")), **change}
    if drop:
        del instance[drop]
    validator = jsonschema.Draft202012Validator(committed("defer_request"))
    assert not validator.is_valid(instance)


def test_export_cli_writes_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "schemas"
    assert main([str(target)]) == 0
    assert sorted(p.name for p in target.iterdir()) == sorted(rendered_json_schemas())
    assert main([str(target), "--check"]) == 0
    (target / "run_task.json").write_text("{}\n", encoding="utf-8")
    (target / "old_kind.json").write_text("{}\n", encoding="utf-8")
    assert main([str(target), "--check"]) == 1
    assert "make schemas" in capsys.readouterr().err
    assert write_json_schemas(target) == ["run_task.json", "old_kind.json"]
    assert write_json_schemas(target, check=True) == ["old_kind.json"]  # stale files are kept
