"""The virtualenv the tests run in is exactly the lock make built it from (locks/).

An upstream release can change nothing here between two commits; a dependency added to
pyproject.toml without `make lock` would be installed unpinned, and fails this test.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.conftest import in_ci

ROOT = Path(__file__).resolve().parent.parent
STAMP = Path(sys.prefix) / "bin" / ".deps"  # written by the Makefile: the lock's path


def _lock() -> Path:
    lock = STAMP.read_text().strip() if STAMP.exists() else ""
    if not lock:
        reason = f"{sys.prefix} was not built by make from a lock (no {STAMP.name} naming one)"
        if in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return ROOT / lock


@pytest.mark.environment
def test_installed_distributions_are_the_lock():
    lock = _lock()
    pinned: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pinned[canonicalize_name(name)] = version
    installed: dict[str, str] = {
        canonicalize_name(dist.metadata["Name"]): dist.version
        for dist in importlib.metadata.distributions()
        if canonicalize_name(dist.metadata["Name"]) != "deferline"
    }
    differ = {
        name: (installed.get(name), pinned.get(name))
        for name in installed.keys() | pinned.keys()
        if installed.get(name) != pinned.get(name)
    }
    assert differ == {}, (
        f"installed != {lock.relative_to(ROOT)} as (installed, locked): {differ}; "
        "'make lock' resolves the locks anew from pyproject.toml"
    )
