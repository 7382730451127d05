"""Which Airflow line is installed, read from its metadata (importing Airflow would load it)."""

from __future__ import annotations

import importlib.metadata


def airflow_line() -> int:
    """The installed Airflow's major version (3 or 2; 0 without Airflow)."""
    try:
        return int(importlib.metadata.version("apache-airflow").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


# Where the built-in triggers live: the standard provider from Airflow 3, core before.
STANDARD_TRIGGERS = (
    "airflow.providers.standard.triggers" if airflow_line() >= 3 else "airflow.triggers"
)


def airflow_version() -> tuple[int, int]:
    """The installed Airflow's (major, minor); (0, 0) without Airflow."""
    try:
        major, minor = importlib.metadata.version("apache-airflow").split(".")[:2]
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)
    return int(major), int(minor)
