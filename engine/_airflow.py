"""Run Apache Airflow's own trigger classes, unmodified, under deferline's supervisor.

Optional (``pip install 'deferline[airflow]'``). Nothing here imports Airflow at module level:
Airflow is imported only when the loader imports a trigger module that needs it. Then:

* Airflow is imported as a library (``_AIRFLOW__AS_LIBRARY``): its configuration is read, but
  ``airflow.settings.initialize()`` does not run, so importing it neither replaces the
  process's logging handlers, nor writes log folders under ``AIRFLOW_HOME``, nor sets up an
  ORM engine. (Set ``_AIRFLOW__AS_LIBRARY`` to an empty string before starting to opt out.)
* An Airflow trigger class is wrapped in an adapter subclass of deferline's ``BaseTrigger``
  (:func:`airflow_trigger_class`): ``serialize()`` is the Airflow trigger's own, ``run()`` maps
  Airflow's ``TriggerEvent`` / ``TaskSuccessEvent`` / ``TaskFailedEvent`` / ``TaskSkippedEvent``
  onto deferline's, ``cleanup()`` and ``log`` are the Airflow trigger's.
* Airflow's metadata database is replaced by a guard: a trigger that opens a database session
  fails with :class:`AirflowDatabaseUnavailable`, never by connecting somewhere by surprise.
  Connections come from ``AIRFLOW_CONN_*`` environment variables (Airflow's environment
  secrets backend), which needs no database.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from ._errors import AirflowDatabaseUnavailable
from ._trigger import (
    BaseTaskEndEvent,
    BaseTrigger,
    TaskFailureEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
    TriggerEvent,
)

__all__ = [
    "AirflowTrigger",
    "airflow_trigger_class",
    "is_airflow_trigger_class",
    "preload_airflow",
    "prepare_airflow_import",
    "to_deferline_event",
]

logger = logging.getLogger(__name__)

_AS_LIBRARY = "_AIRFLOW__AS_LIBRARY"
_BASE_MODULE = "airflow.triggers.base"
_END_EVENTS: dict[str, type[BaseTaskEndEvent]] = {
    "success": TaskSuccessEvent,
    "failed": TaskFailureEvent,
    "skipped": TaskSkippedEvent,
}
_lock = threading.Lock()
_guarded = False


@functools.cache
def _airflow_installed() -> bool:
    # find_spec of a top-level name locates the package without importing it.
    return importlib.util.find_spec("airflow") is not None


def prepare_airflow_import() -> None:
    """Before importing a module that may import Airflow: have Airflow load as a library.

    A no-op when Airflow is not installed or already imported. Called by the trigger and
    operator loaders before every import, after the allowlist check.
    """
    if "airflow" in sys.modules or not _airflow_installed():
        return
    os.environ.setdefault(_AS_LIBRARY, "1")


def is_airflow_trigger_class(cls: type) -> bool:
    """True when ``cls`` subclasses Airflow's ``BaseTrigger`` (checked without importing it)."""
    return any(
        klass.__module__ == _BASE_MODULE and klass.__name__ == "BaseTrigger"
        for klass in getattr(cls, "__mro__", ())
    )


class _NoDatabaseSession:
    """Stands in for ``airflow.settings.Session``: opening a session is the error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AirflowDatabaseUnavailable(
            "this Airflow trigger needs Airflow's metadata database (it opened a database "
            "session, e.g. to query task instances or DAG runs); deferline's triggerer runs "
            "Airflow triggers without that database, so triggers that read Airflow's tables "
            "cannot run here"
        )

    @staticmethod
    def remove() -> None:
        """``Session.remove()`` of a ``scoped_session``: nothing to release."""


def _guard_database() -> None:
    """Make any use of Airflow's ORM raise :class:`AirflowDatabaseUnavailable`."""
    global _guarded
    with _lock:
        if _guarded:
            return
        settings: Any = importlib.import_module("airflow.settings")
        settings.Session = _NoDatabaseSession
        settings.engine = None
        # Airflow's models (Connection among them) are SQLAlchemy classes whose mappers
        # resolve each other by name on first use; without settings.initialize() nothing has
        # imported them all, and building a Connection from AIRFLOW_CONN_* would fail.
        models: Any = importlib.import_module("airflow.models")
        models.import_all_models()
        _guarded = True


def preload_airflow(allowed_prefixes: Sequence[str]) -> bool:
    """Load Airflow now if an allowed trigger prefix is under ``airflow``; True if it did.

    Importing Airflow and its models takes seconds of CPU. A triggerer calls this in a thread
    before it joins its consumer group, so the first Airflow trigger it loads does not block
    the event loop (and the group's heartbeats) for that long. A no-op without Airflow.
    """
    wanted = [p.strip().rstrip(".") for p in allowed_prefixes]
    if not any(p == "airflow" or p.startswith("airflow.") for p in wanted):
        return False
    if not _airflow_installed():
        return False
    prepare_airflow_import()
    importlib.import_module("airflow.triggers.base")
    _guard_database()
    logger.info("Airflow loaded for its trigger classes (as a library, without its database)")
    return True


def to_deferline_event(event: Any) -> TriggerEvent:
    """Map one event an Airflow trigger yielded onto deferline's event of the same meaning.

    Airflow's ``TaskSuccessEvent`` / ``TaskFailedEvent`` / ``TaskSkippedEvent`` keep their
    ``xcoms``; any other ``TriggerEvent`` keeps its payload unchanged.
    """
    if isinstance(event, TriggerEvent):
        return event
    state = getattr(event, "task_instance_state", None)
    if state is not None:
        end = _END_EVENTS.get(str(getattr(state, "value", state)))
        if end is None:
            raise TypeError(f"Airflow trigger ended the task in unsupported state {state!r}")
        return end(xcoms=getattr(event, "xcoms", None))
    if not hasattr(event, "payload"):
        raise TypeError(f"Airflow trigger yielded {type(event).__name__}, not a TriggerEvent")
    return TriggerEvent(event.payload)


class AirflowTrigger(BaseTrigger):
    """A deferline trigger that runs one Airflow trigger instance, unmodified.

    Built per Airflow class by :func:`airflow_trigger_class`; ``cls(**kwargs)`` builds the
    Airflow trigger from the kwargs its own ``serialize()`` produced.
    """

    airflow_class: ClassVar[type]

    def __init__(self, **kwargs: Any) -> None:
        self.airflow_trigger: Any = self.airflow_class(**kwargs)
        super().__init__()

    # The runner sets these before run(), as Airflow's triggerer does on its own triggers.
    @property
    def trigger_id(self) -> str | None:
        value: str | None = getattr(self.airflow_trigger, "trigger_id", None)
        return value

    @trigger_id.setter
    def trigger_id(self, value: str | None) -> None:
        self.airflow_trigger.trigger_id = value

    @property
    def task_instance(self) -> Any:
        return getattr(self.airflow_trigger, "task_instance", None)

    @task_instance.setter
    def task_instance(self, value: Any) -> None:
        self.airflow_trigger.task_instance = value

    def serialize(self) -> tuple[str, dict[str, Any]]:
        classpath, kwargs = self.airflow_trigger.serialize()
        return str(classpath), dict(kwargs)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        events = self.airflow_trigger.run()
        try:
            while True:
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    return
                except AirflowDatabaseUnavailable as exc:
                    # Raised deep inside Airflow's session helpers: report it from here.
                    raise AirflowDatabaseUnavailable(f"{self.classpath}: {exc}") from None
                yield to_deferline_event(event)
        finally:
            await events.aclose()

    async def cleanup(self) -> None:
        await self.airflow_trigger.cleanup()

    @property
    def classpath(self) -> str:
        cls = self.airflow_class
        return f"{cls.__module__}.{cls.__qualname__}"

    @property
    def log(self) -> logging.Logger:
        """The Airflow trigger's own logger (``LoggingMixin.log``)."""
        log: logging.Logger = self.airflow_trigger.log
        return log


@functools.cache
def airflow_trigger_class(airflow_class: type) -> type[AirflowTrigger]:
    """The deferline trigger class that runs ``airflow_class`` (one per Airflow class).

    It carries the Airflow class's module and name, so logs and metrics name the trigger the
    user wrote. Installs the database guard the first time.
    """
    if not is_airflow_trigger_class(airflow_class):
        raise TypeError(f"{airflow_class!r} is not an Airflow BaseTrigger subclass")
    _guard_database()
    namespace = {
        "airflow_class": airflow_class,
        "__module__": airflow_class.__module__,
        "__qualname__": airflow_class.__qualname__,
        "__doc__": airflow_class.__doc__,
    }
    adapter: type[AirflowTrigger] = type(airflow_class.__name__, (AirflowTrigger,), namespace)
    return adapter
