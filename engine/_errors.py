"""Errors of the trigger engine: loading a trigger and running the supervisor."""

from __future__ import annotations

from deferline.schemas import DeferlineError

__all__ = [
    "AirflowDatabaseUnavailable",
    "AirflowEnvironmentError",
    "AirflowServicesUnavailable",
    "SupervisorError",
    "TriggerImportError",
    "TriggerKwargsError",
    "TriggerLoadError",
    "TriggerNotAllowed",
]


class TriggerLoadError(DeferlineError):
    """A trigger named by a request could not be turned into a runnable instance."""

    def __init__(self, message: str, *, classpath: str) -> None:
        super().__init__(message)
        self.classpath = classpath


class TriggerNotAllowed(TriggerLoadError):
    """The classpath is outside the allowed module prefixes, or is not a BaseTrigger subclass."""


class TriggerImportError(TriggerLoadError):
    """The trigger's module or class could not be imported."""


class TriggerKwargsError(TriggerLoadError):
    """The trigger class rejected its keyword arguments."""


class SupervisorError(DeferlineError):
    """The trigger supervisor was used outside its lifecycle (not started, or stopped)."""


class AirflowDatabaseUnavailable(DeferlineError):
    """An Airflow trigger needed Airflow's metadata database, which deferline runs without."""


class AirflowEnvironmentError(DeferlineError):
    """An installed dependency is at a version the installed Airflow is known not to run with."""


class AirflowServicesUnavailable(DeferlineError):
    """No Airflow services server (``deferline airflow bridge --services-port``) answered an
    Airflow trigger's request in time."""
