"""JSON Schemas of the wire records, one self-contained document per record kind."""

from __future__ import annotations

import json
from typing import Any

from ._models import RECORD_TYPES, SCHEMA_VERSION

__all__ = ["record_json_schemas", "rendered_json_schemas"]

DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _schema_id(kind: str) -> str:
    return f"urn:deferline:schema:{kind}:v{SCHEMA_VERSION}"


def record_json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schema of each record kind (``kind`` → schema), as this build validates it.

    ``kind`` and ``version`` are required on the wire even though the Python models default
    them; every other field with a default may be left out. Unknown fields are allowed (and
    ignored by readers of the same version).
    """
    schemas: dict[str, dict[str, Any]] = {}
    for kind, model in RECORD_TYPES.items():
        schema = model.model_json_schema(mode="validation")
        schema["properties"]["version"] = {
            "const": SCHEMA_VERSION,
            "description": "Schema version of this record.",
            "title": "Version",
            "type": "integer",
        }
        required = [name for name in schema.get("required", []) if name not in ("kind", "version")]
        schema["required"] = ["kind", "version", *required]
        schemas[kind] = {
            "$schema": DIALECT,
            "$id": _schema_id(kind),
            "version": SCHEMA_VERSION,
            **schema,
        }
    return schemas


def rendered_json_schemas() -> dict[str, str]:
    """File name → file text of every schema: sorted keys, two-space indent, final newline."""
    return {
        f"{kind}.json": json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        for kind, schema in record_json_schemas().items()
    }
