"""Which versions of their dependencies the Airflow lines run with, checked before Airflow runs.

Airflow's own requirements are ranges open at the top, so a new release of a dependency can
break an Airflow line that was released long before it. Those breaks are listed here, each with
its reason, and checked from installed metadata (nothing is imported): the bridge refuses to
start on an environment that has one, a triggerer says so in its log. ``deferline[airflow2]``
bounds the same dependencies, so a fresh install does not meet them.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

from ._errors import AirflowEnvironmentError

__all__ = [
    "KNOWN_BREAKS",
    "KnownBreak",
    "airflow_environment_problems",
    "check_airflow_environment",
]


@dataclass(frozen=True, slots=True)
class KnownBreak:
    """A dependency's releases that an Airflow line does not run with, and why."""

    airflow: str
    """Specifier of the Airflow versions affected (``>=2.10,<3``)."""
    distribution: str
    """The dependency's distribution name."""
    supported: str
    """Specifier of the dependency's versions those Airflow versions run with."""
    reason: str


KNOWN_BREAKS: tuple[KnownBreak, ...] = (
    KnownBreak(
        airflow=">=2.10,<3",
        distribution="cryptography",
        supported="<51",
        reason=(
            "cryptography 51's MultiFernet is a native type that takes no new attribute, and "
            "Airflow 2.10's get_fernet() sets `is_encrypted` on it: with a Fernet key configured "
            "every encrypted trigger kwarg, connection or variable fails with AttributeError"
        ),
    ),
)


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def airflow_environment_problems(
    version_of: Callable[[str], str | None] = _installed,
    breaks: tuple[KnownBreak, ...] = KNOWN_BREAKS,
) -> list[str]:
    """One sentence per installed dependency its Airflow line does not run with; empty if none.

    ``version_of`` maps a distribution name to its installed version (None: not installed).
    """
    airflow = version_of("apache-airflow")
    if airflow is None:
        return []
    # Airflow requires packaging, so it is there whenever Airflow is.
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    problems = []
    for known in breaks:
        installed = version_of(known.distribution)
        if installed is None or Version(airflow) not in SpecifierSet(known.airflow):
            continue
        if Version(installed) not in SpecifierSet(known.supported):
            problems.append(
                f"Airflow {airflow} needs {known.distribution}{known.supported}, and "
                f"{known.distribution} {installed} is installed: {known.reason}. Install "
                f"'{known.distribution}{known.supported}'"
            )
    return problems


def check_airflow_environment(version_of: Callable[[str], str | None] = _installed) -> None:
    """Raise :class:`AirflowEnvironmentError` naming every known break installed here."""
    if problems := airflow_environment_problems(version_of):
        raise AirflowEnvironmentError("; ".join(problems))
