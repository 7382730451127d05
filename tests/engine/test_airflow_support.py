"""The installed versions an Airflow line is known not to run with are named before it runs."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from deferline.engine import (
    KNOWN_BREAKS,
    AirflowEnvironmentError,
    airflow_environment_problems,
    check_airflow_environment,
)
from deferline.runners.cli import main
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def installed(**versions: str):
    """A ``version_of`` that sees exactly ``versions`` (keys with ``_`` for ``-``)."""
    table = {name.replace("_", "-"): version for name, version in versions.items()}
    return table.get


def test_airflow_2_10_with_cryptography_51_is_named_with_its_reason():
    problems = airflow_environment_problems(
        installed(apache_airflow="2.10.5", cryptography="51.0.1")
    )
    assert len(problems) == 1
    assert "Airflow 2.10.5 needs cryptography<51" in problems[0]
    assert "cryptography 51.0.1 is installed" in problems[0]
    assert "get_fernet() sets `is_encrypted`" in problems[0]


def test_the_check_raises_a_deferline_error_naming_the_fix():
    with pytest.raises(AirflowEnvironmentError, match=r"Install 'cryptography<51'"):
        check_airflow_environment(installed(apache_airflow="2.10.5", cryptography="51.0.1"))


@pytest.mark.parametrize(
    "versions",
    [
        {"apache_airflow": "2.10.5", "cryptography": "50.0.2"},
        {"apache_airflow": "3.3.2", "cryptography": "51.0.1"},  # Airflow 3 wraps MultiFernet
        {"cryptography": "51.0.1"},  # no Airflow: nothing to check
        {"apache_airflow": "2.10.5"},
    ],
)
def test_supported_environments_have_no_problem(versions):
    assert airflow_environment_problems(installed(**versions)) == []
    check_airflow_environment(installed(**versions))


def _extra(name: str) -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(spec) for spec in project["optional-dependencies"][name]]
    return {requirement.name: requirement for requirement in requirements}


@pytest.mark.parametrize("extra", ["airflow", "airflow2"])
def test_each_airflow_extra_excludes_every_known_break_of_its_line(extra):
    """What ``pip install 'deferline[<extra>]'`` resolves never meets a known break."""
    requirements = _extra(extra)
    airflow_range = requirements["apache-airflow"].specifier
    # ~=X.Y.Z: the lowest release of the line it allows is X.Y.Z.
    lowest = Version(re.sub(r"^[~=>]+", "", str(airflow_range)))
    for known in KNOWN_BREAKS:
        if lowest not in SpecifierSet(known.airflow):
            continue
        bound = requirements.get(known.distribution)
        assert bound is not None, f"{extra} must bound {known.distribution}{known.supported}"
        assert set(SpecifierSet(known.supported)) <= set(bound.specifier), (
            f"deferline[{extra}] allows {known.distribution}{bound.specifier}, but "
            f"{known.supported} is what Airflow {lowest} runs with: {known.reason}"
        )


def test_the_bridge_refuses_to_start_on_a_known_break(monkeypatch):
    fake = {"apache-airflow": "2.10.5", "cryptography": "51.0.1"}
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: fake.get(name) or real(name))
    result = CliRunner().invoke(main, ["airflow", "bridge"])
    assert result.exit_code == 1, result.output
    assert "unsupported Airflow environment: Airflow 2.10.5 needs cryptography<51" in (
        result.output
    )
