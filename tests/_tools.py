"""Test helper: a program the tests run, found on PATH or the test failed (CI) or skipped."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import in_ci


def system_program(*names: str, package: str) -> str:
    """The path of the first of ``names`` on PATH; else fail in CI, skip elsewhere."""
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    reason = f"no {names[0]} on PATH (Debian: apt-get install -y {package})"
    if in_ci():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)
