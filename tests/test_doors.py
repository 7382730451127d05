"""Tests and benchmarks reach deferline through its public doors, never a private module.

A package's ``__init__`` is its door; what a test needs beyond it comes from that package's
``testing`` module. An import of ``deferline.<pkg>._<module>`` ties a test of behaviour to the
file layout, so moving a module would break it. ``tests.*`` helper modules are the tests' own.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("tests", "bench")


def _private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):  # a parent that is a module, not a package
        return False


def _private_imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module path) for each import of a private deferline module in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("deferline.") and _private(alias.name):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            if module != "deferline" and not module.startswith("deferline."):
                continue
            if _private(module):
                yield node.lineno, module
                continue
            for alias in node.names:  # from deferline.topics import _process
                dotted = f"{module}.{alias.name}"
                if alias.name.startswith("_") and _is_module(dotted):
                    yield node.lineno, dotted


def test_no_test_or_benchmark_imports_a_private_module() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, module in sorted(_private_imports(ast.parse(path.read_text(), str(path))))
    ]
    assert found == [], "import from the package or its testing door instead:\n" + "\n".join(found)


def test_the_check_sees_each_form_of_private_import() -> None:
    source = (
        "import deferline.topics._clients\n"
        "from deferline.engine._slots import SlotBook\n"
        "from deferline.topics import _process\n"
        "from deferline.engine.testing import SlotBook, _Run\n"
        "from deferline.topics import Settings\n"
        "from tests.integration._util import until\n"
        "from ._examples import RECORDS\n"
    )
    assert list(_private_imports(ast.parse(source))) == [
        (1, "deferline.topics._clients"),
        (2, "deferline.engine._slots"),
        (3, "deferline.topics._process"),
    ]
