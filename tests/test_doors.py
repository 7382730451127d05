"""Tests and benchmarks reach deferline through its public doors, never a private module.

A package's ``__init__`` is its door; what a test needs beyond it comes from that package's
``testing`` module. An import of ``deferline.<pkg>._<module>`` ties a test of behaviour to the
file layout, so moving a module would break it. ``tests.*`` helper modules are the tests' own.
A testing door exports public names only: it gives each private name it passes on a public one,
and tests and benchmarks use that, never the underscore name behind it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import tomllib
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


def _is_door(dotted: str) -> bool:
    return dotted.startswith("deferline.") and dotted.endswith(".testing")


def _doors() -> list[str]:
    """Module path of each testing door in the packages pyproject.toml maps."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return [
        ".".join((package, *path.relative_to(ROOT / folder).with_suffix("").parts))
        for package, folder in setuptools["package-dir"].items()
        for path in sorted((ROOT / folder).rglob("testing.py"))
    ]


def _sources() -> Iterator[tuple[Path, ast.AST]]:
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


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


def _private_door_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) for each underscore name ``tree`` takes from a testing door."""
    doors: set[str] = set()  # what the door modules are called in ``tree``
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_door(alias.name):
                    doors.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _is_door(node.module):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        yield node.lineno, f"{node.module}.{alias.name}"
            elif node.module.startswith("deferline"):
                for alias in node.names:
                    if _is_door(f"{node.module}.{alias.name}"):
                        doors.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            owner = ast.unparse(node.value)
            if owner in doors:
                yield node.lineno, f"{owner}.{node.attr}"


def test_no_test_or_benchmark_imports_a_private_module() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path, tree in _sources()
        for line, module in sorted(_private_imports(tree))
    ]
    assert found == [], "import from the package or its testing door instead:\n" + "\n".join(found)


def test_no_test_or_benchmark_takes_an_underscore_name_from_a_door() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path, tree in _sources()
        for line, name in sorted(_private_door_names(tree))
    ]
    assert found == [], "use the public name the door gives it:\n" + "\n".join(found)


def test_no_door_exports_an_underscore_name() -> None:
    doors = _doors()
    assert "deferline.topics.testing" in doors
    assert "deferline.runners.triggerer.testing" in doors
    found = [
        f"{door}: {name}"
        for door in doors
        for name in importlib.import_module(door).__all__
        if name.startswith("_")
    ]
    assert found == [], "export it as `_name as name`:\n" + "\n".join(found)


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


def test_the_check_sees_each_way_to_an_underscore_name_of_a_door() -> None:
    source = (
        "from deferline.engine.testing import SlotBook, _Run\n"
        "from deferline.topics.testing import (\n"
        "    free_port,\n"
        "    _unsigned as unsigned,\n"
        ")\n"
        "import deferline.schemas.testing\n"
        "import deferline.replay.testing as replay_doors\n"
        "from deferline.runners.scheduler import testing as scheduler_doors\n"
        "from deferline.runners import testing\n"
        "deferline.schemas.testing._Record\n"
        "replay_doors._KEEP\n"
        "getattr(scheduler_doors, 'read_event')\n"
        "scheduler_doors._parse_pools\n"
        "testing._as_json\n"
        "from deferline.engine.testing import Run\n"
        "from deferline.topics import _process\n"
        "from click.testing import _Private\n"
        "from . import testing as local\n"
        "local._name\n"
    )
    assert sorted(_private_door_names(ast.parse(source))) == [
        (1, "deferline.engine.testing._Run"),
        (2, "deferline.topics.testing._unsigned"),
        (10, "deferline.schemas.testing._Record"),
        (11, "replay_doors._KEEP"),
        (13, "scheduler_doors._parse_pools"),
        (14, "testing._as_json"),
    ]
