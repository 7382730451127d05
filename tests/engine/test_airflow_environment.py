"""The installed Airflow line runs with the versions of its dependencies installed here."""

from __future__ import annotations

import pytest
from deferline.engine import airflow_environment_problems


@pytest.mark.airflow
@pytest.mark.environment
def test_installed_airflow_meets_no_known_break():
    problems = airflow_environment_problems()
    assert problems == [], "unsupported Airflow environment:\n" + "\n".join(problems)
