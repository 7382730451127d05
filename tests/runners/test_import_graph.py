"""The modules of a runner import each other without a circle (type-only imports count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNNERS = Path(__file__).resolve().parents[2] / "runners"


def _imports(package: Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        graph[path.stem] = {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        }
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle once, starting at its smallest module."""
    found: set[tuple[str, ...]] = set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == path[0]:
                found.add((*path, nxt))
            elif nxt not in path and nxt > path[0]:
                walk([*path, nxt])

    for start in sorted(graph):
        walk([start])
    return sorted(list(circle) for circle in found)


@pytest.mark.parametrize(
    "runner", ["triggerer", "scheduler", "airflow_bridge", "worker", "member", "console", "demo"]
)
def test_no_import_circle(runner: str) -> None:
    assert _circles(_imports(RUNNERS / runner)) == []


def test_the_check_sees_a_circle_through_a_type_only_import(tmp_path: Path) -> None:
    (tmp_path / "_a.py").write_text("from ._b import B\n")
    (tmp_path / "_b.py").write_text("from . import _c\nfrom ._c import C\n")
    (tmp_path / "_c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._a import A\n"
    )
    (tmp_path / "_d.py").write_text("from ._a import A\nfrom deferline.topics import x\n")
    assert _circles(_imports(tmp_path)) == [["_a", "_b", "_c", "_a"]]


@pytest.mark.parametrize(
    ("role", "other"), [("triggerer", "scheduler"), ("scheduler", "triggerer")]
)
def test_no_role_imports_the_other(role: str, other: str) -> None:
    # What both need lives in deferline.runners.member.
    found = [
        f"{path.name}:{node.lineno}"
        for path in sorted((RUNNERS / role).glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom)
        and (
            (node.level == 2 and (node.module or "").split(".")[0] == other)
            or (node.module or "").startswith(f"deferline.runners.{other}")
        )
    ]
    assert found == []
