"""The shipped alert rules pass `promtool test rules`; rules and dashboard name real metrics."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests._tools import system_program

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "monitoring"
RULES, RULES_TESTS = "deferline-rules.yml", "deferline-rules.test.yml"
_NAME = re.compile(r"\bdeferline_[a-z_]+")
_SUFFIX = re.compile(r"_(total|bucket|sum|count)$")


def exported_metrics() -> set[str]:
    """Every metric name the processes register (string literals in engine/ and runners/)."""
    found: set[str] = set()
    for folder in ("engine", "runners"):
        for path in (ROOT / folder).rglob("*.py"):
            found.update(re.findall(r'"(deferline_[a-z_]+)"', path.read_text()))
    return found


def test_the_rules_pass_promtools_unit_tests() -> None:
    promtool = system_program("promtool", package="prometheus")
    for command in (["check", "rules", RULES], ["test", "rules", RULES_TESTS]):
        run = subprocess.run(
            [promtool, *command], cwd=MONITORING, capture_output=True, text=True, check=False
        )
        assert run.returncode == 0, run.stdout + run.stderr


def test_every_alert_has_a_unit_test() -> None:
    rules = (MONITORING / "deferline-rules.yml").read_text()
    tests = (MONITORING / "deferline-rules.test.yml").read_text()
    alerts = re.findall(r"^\s*- alert: (\w+)", rules, re.MULTILINE)
    assert len(alerts) == 8
    assert [a for a in alerts if f"alertname: {a}" not in tests] == []


@pytest.mark.parametrize("name", ["deferline-rules.yml", "deferline-dashboard.json"])
def test_rules_and_dashboard_name_only_exported_metrics(name: str) -> None:
    text = (MONITORING / name).read_text()
    if name.endswith(".json"):
        dashboard = json.loads(text)
        text = "\n".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    used = {_SUFFIX.sub("", m) for m in _NAME.findall(text)}
    assert used
    assert sorted(used - exported_metrics()) == []
