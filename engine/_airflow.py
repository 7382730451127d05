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
* Airflow 3's triggers ask their triggerer's supervisor process for what they need
  (``task_runner.SUPERVISOR_COMMS``). With :func:`use_airflow_services` (the triggerer's
  ``DEFERLINE_AIRFLOW_SERVICES``), a :class:`~._airflow_services.RemoteSupervisor` sends
  those requests to a server that answers them from Airflow's database with Airflow's own
  handlers (``deferline airflow bridge --services-port``): connections and variables stored
  there, XCom, task-instance and DAG-run state, human-in-the-loop. Without it,
  :class:`_SupervisorStandIn` answers: connections and variables come from Airflow's own
  lookup code (the ``AIRFLOW_CONN_*`` / ``AIRFLOW_VAR_*`` environment variables and a
  configured secrets backend), and what only the database knows fails the trigger with
  :class:`AirflowDatabaseUnavailable` naming the request. Airflow 2.10's triggers read the
  database themselves: with :func:`use_airflow_services`, an
  :class:`~._airflow2_services.Airflow2Services` asks the servers in the place of the reads
  they make (the metastore's lookups, ``WorkflowTrigger``'s and ``DagStateTrigger``'s counts).
* Airflow's ``DateTimeTrigger`` (and ``TimeDeltaTrigger``, which is one) declares itself a
  timer (:meth:`AirflowTrigger.as_timer`), so the supervisor keeps it in its timer heap.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import AsyncGenerator, AsyncIterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ._airflow2_services import Airflow2Services
from ._airflow_services import RemoteSupervisor, ServicesClient
from ._airflow_support import airflow_environment_problems
from ._errors import AirflowDatabaseUnavailable
from ._shared_streams import shared_streams
from ._trigger import (
    BaseTaskEndEvent,
    BaseTrigger,
    TaskFailureEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
    TimerSpec,
    TriggerEvent,
)

if TYPE_CHECKING:
    from deferline.schemas import KwargsCipher

__all__ = [
    "AirflowTrigger",
    "airflow_trigger_class",
    "close_airflow_services",
    "is_airflow_trigger_class",
    "preload_airflow",
    "prepare_airflow_import",
    "to_deferline_event",
    "use_airflow_services",
]

logger = logging.getLogger(__name__)

_AS_LIBRARY = "_AIRFLOW__AS_LIBRARY"
_NO_PORTAL = "AIRFLOW_DISABLE_GREENBACK_PORTAL"
_UTC = dt.UTC
_BASE_MODULE = "airflow.triggers.base"
# Airflow's DateTimeTrigger: in core up to 2.x, in the standard provider from 3.0.
_DATETIME_TRIGGERS = frozenset(
    {
        "airflow.triggers.temporal.DateTimeTrigger",
        "airflow.providers.standard.triggers.temporal.DateTimeTrigger",
    }
)
# Airflow 3's triggerer answers these from the environment or a secrets backend when it can;
# the stand-in answers "not found" once Airflow's own lookup has tried those.
_NOT_FOUND = {"GetConnection": "CONNECTION_NOT_FOUND", "GetVariable": "VARIABLE_NOT_FOUND"}
_END_EVENTS: dict[str, type[BaseTaskEndEvent]] = {
    "success": TaskSuccessEvent,
    "failed": TaskFailureEvent,
    "skipped": TaskSkippedEvent,
}
# Attributes of every LogRecord: a structlog key of the same name is renamed, not clobbered.
_RECORD_FIELDS = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys() | {"message", "asctime"}
)
_lock = threading.Lock()
_guarded = False
_services: tuple[tuple[str, ...], float, KwargsCipher | None] | None = None
_remote: RemoteSupervisor | Airflow2Services | None = None


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


def _database_needed(what: str) -> AirflowDatabaseUnavailable:
    return AirflowDatabaseUnavailable(
        f"this Airflow trigger needs Airflow's metadata database ({what}); deferline's "
        "triggerer runs Airflow triggers without that database: on Airflow 3, set "
        "DEFERLINE_AIRFLOW_SERVICES to a `deferline airflow bridge --services-port` URL to "
        "have these requests answered from it"
    )


class _NoDatabaseSession:
    """Stands in for ``airflow.settings.Session``: opening a session is the error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _database_needed(
            "it opened a database session, e.g. to query task instances or DAG runs"
        )

    @staticmethod
    def remove() -> None:
        """``Session.remove()`` of a ``scoped_session``: nothing to release."""


class _SupervisorStandIn:
    """Stands in for Airflow 3's triggerer supervisor (``task_runner.SUPERVISOR_COMMS``).

    Airflow's own code asks it only after the environment and any configured secrets backend
    (``ExecutionAPISecretsBackend`` comes last in a triggerer's search path), so a connection
    or variable it is asked for exists nowhere it can look: it answers Airflow's "not found".
    A secret to mask is already masked in this process. Anything else needs Airflow's
    database: :class:`AirflowDatabaseUnavailable`, naming the request. Every answer is
    immediate, so a sync call made inside the event loop returns or raises, never waits.
    """

    def send(self, msg: Any) -> Any:
        kind = type(msg).__name__
        if kind == "MaskSecret":
            return None
        error = _NOT_FOUND.get(kind)
        if error is None:
            raise _database_needed(f"it asked Airflow's triggerer for {kind}: {msg!r}")
        comms: Any = importlib.import_module("airflow.sdk.execution_time.comms")
        errors: Any = importlib.import_module("airflow.sdk.exceptions")
        return comms.ErrorResponse(error=errors.ErrorType[error], detail=msg.model_dump())

    async def asend(self, msg: Any) -> Any:
        return self.send(msg)


def _to_stdlib(
    logger: Any, method: str, event: MutableMapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """structlog's last step: the message to the stdlib logger, its key-values as fields."""
    message = event.pop("event", "")
    exc_info = event.pop("exc_info", None)
    extra = {(f"airflow_{k}" if k in _RECORD_FIELDS else k): v for k, v in event.items()}
    return (message,), {"exc_info": exc_info, "extra": extra}


def _log_through_stdlib() -> None:
    """Airflow 3 logs through structlog (``self.log`` of a trigger is a structlog logger):
    unless something configured structlog already, send it to the stdlib logger of the same
    name, so a trigger's lines reach the triggerer's log with its level and format."""
    structlog: Any = importlib.import_module("structlog")
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.stdlib.PositionalArgumentsFormatter(),
            _to_stdlib,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def _stand_in_for_airflow_services() -> None:
    """Once per process, stand in for what Airflow's triggerer sets up around its triggers:
    any use of Airflow's ORM, or of Airflow 3's supervisor channel for what only the database
    knows, raises :class:`AirflowDatabaseUnavailable`; Airflow 3's structlog logging goes to
    stdlib logging; Airflow 2's secrets masker is in place."""
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
        _install_services()
        if importlib.util.find_spec("airflow.sdk") is not None:  # Airflow 3
            _log_through_stdlib()
        else:
            # Airflow 2 masks every secret it reads (Variable.get, connections) with the filter
            # its logging configuration puts on "airflow.task", and fails without it.
            masker: Any = importlib.import_module("airflow.utils.log.secrets_masker")
            task_log = logging.getLogger("airflow.task")
            if not any(isinstance(f, masker.SecretsMasker) for f in task_log.filters):
                task_log.addFilter(masker.SecretsMasker())
        _guarded = True


def _install_services() -> None:
    """What answers the installed Airflow line's runtime requests (with ``_lock`` held)."""
    if importlib.util.find_spec("airflow.sdk") is not None:  # Airflow 3
        _install_supervisor()
    else:
        _install_airflow2_services()


def _install_supervisor() -> None:
    """Airflow 3's ``SUPERVISOR_COMMS``: the remote servers when configured, else the
    stand-in (with ``_lock`` held)."""
    global _remote
    if _remote is not None:
        _close_later(_remote.client)
    _remote = None
    if _services is not None:
        urls, timeout, cipher = _services
        _remote = RemoteSupervisor(urls, timeout=timeout, cipher=cipher)
    task_runner: Any = importlib.import_module("airflow.sdk.execution_time.task_runner")
    task_runner.SUPERVISOR_COMMS = _remote or _SupervisorStandIn()


def _install_airflow2_services() -> None:
    """Airflow 2.10's database reads asked of the remote servers when configured, else left
    to the database guard (with ``_lock`` held)."""
    global _remote
    if isinstance(_remote, Airflow2Services):
        _remote.uninstall()
        _close_later(_remote.client)
    _remote = None
    if _services is not None:
        urls, timeout, cipher = _services
        _remote = Airflow2Services(ServicesClient(urls, timeout=timeout, cipher=cipher))
        _remote.install()


def _close_later(client: ServicesClient) -> None:
    with contextlib.suppress(RuntimeError):  # no loop running: nothing open to close
        asyncio.get_running_loop().create_task(client.close())


def use_airflow_services(
    urls: Sequence[str], *, timeout: float = 30.0, cipher: KwargsCipher | None = None
) -> None:
    """Have Airflow triggers' runtime requests (Airflow 3) or database reads (2.10) answered
    by these servers (``deferline airflow bridge --services-port``), tried in turn until none
    has answered for ``timeout`` seconds; an empty ``urls`` goes back to the stand-in (3) or
    the database guard (2.10). A triggerer calls it before loading Airflow."""
    global _services
    with _lock:
        _services = (tuple(urls), timeout, cipher) if urls else None
        if _guarded:
            _install_services()


async def close_airflow_services() -> None:
    """Close the connections to the services servers (a triggerer stopping); the next request
    opens them again."""
    remote = _remote
    if remote is not None:
        await remote.client.close()


def _runs_as_timer(airflow_class: type) -> bool:
    """True when ``airflow_class`` is Airflow's DateTimeTrigger, or a subclass of it (such as
    TimeDeltaTrigger) that keeps its ``run``, ``cleanup`` and ``on_kill``."""
    for klass in airflow_class.__mro__:
        if f"{klass.__module__}.{klass.__qualname__}" in _DATETIME_TRIGGERS:
            return all(
                getattr(airflow_class, name, None) is getattr(klass, name, None)
                for name in ("run", "cleanup", "on_kill")
            )
    return False


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
    for problem in airflow_environment_problems():
        logger.warning("unsupported Airflow environment: %s", problem)
    prepare_airflow_import()
    importlib.import_module("airflow.triggers.base")
    _stand_in_for_airflow_services()
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
    airflow_timer: ClassVar[bool]
    imports_from_kwargs: ClassVar[tuple[str, ...]] = ()
    """Kwargs naming what the trigger imports and runs (checked against the allowed
    prefixes by the loader, as the trigger's own classpath is)."""

    def __init__(self, **kwargs: Any) -> None:
        # Not BaseTrigger.__init__: trigger_id and task_instance are the Airflow trigger's,
        # which its own __init__ set to None.
        self.airflow_trigger: Any = self.airflow_class(**kwargs)

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
        remote = _remote
        if remote is not None and os.environ.get(_NO_PORTAL, "").lower() != "true":
            # Airflow's triggers call Variable.get / get_connection synchronously inside
            # run(): greenback lets that call await the answer without blocking the loop.
            # Airflow's own switch turns it off (sync calls then fail, saying so).
            await remote.client.ensure_portal()
        events = self._events()
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

    def _events(self) -> AsyncGenerator[Any, None]:
        """The Airflow trigger's events: its ``run()``; the ``run()`` of its deferline form
        for a class that offers one (``deferline_trigger()``, as the classes of
        ``deferline.engine.triggers.airflow`` do); or, for an event trigger that shares its
        stream with siblings (``shared_stream_key``, Airflow 3.3), its
        ``filter_shared_stream`` over the one stream of its key in this process, as
        Airflow's triggerer runs it (ack mode, ``create_shared_stream_producer``, is not
        shared here: such a trigger runs on its own)."""
        trigger = self.airflow_trigger
        native = getattr(trigger, "deferline_trigger", None)
        if callable(native):  # an Airflow face of a deferline trigger: its deferline form
            return native().run()  # type: ignore[no-any-return]
        key = _shared_stream_key(trigger)
        if key is None:
            return trigger.run()  # type: ignore[no-any-return]
        cls = type(trigger)
        kwargs = dict(trigger.serialize()[1])
        stream = shared_streams().subscribe((cls, key), lambda: cls.open_shared_stream(kwargs))
        return trigger.filter_shared_stream(stream)  # type: ignore[no-any-return]

    async def cleanup(self) -> None:
        await self.airflow_trigger.cleanup()

    async def on_kill(self) -> None:
        """The Airflow trigger's ``on_kill()`` (Airflow 3.3 and later; 2.10 has none)."""
        on_kill = getattr(self.airflow_trigger, "on_kill", None)
        if on_kill is not None:
            await on_kill()

    def as_timer(self) -> TimerSpec | None:
        """Airflow's DateTimeTrigger as a timer: due at its ``moment``, with the event its own
        ``run()`` yields then (``TriggerEvent(moment)``, or ``TaskSuccessEvent()`` when it
        ends the task from the trigger)."""
        if not self.airflow_timer:
            return None
        trigger = self.airflow_trigger
        # Airflow's moment is a pendulum DateTime in UTC; the same instant as a plain UTC
        # datetime is equal to it and travels as the same tagged JSON (same event id), and
        # lets the supervisor rebuild it when it fires instead of keeping it per timer.
        m = trigger.moment
        moment = dt.datetime(
            m.year, m.month, m.day, m.hour, m.minute, m.second, m.microsecond, _UTC
        )
        event = TaskSuccessEvent() if trigger.end_from_trigger else TriggerEvent(moment)
        return TimerSpec(moment, event)

    @property
    def classpath(self) -> str:
        cls = self.airflow_class
        return f"{cls.__module__}.{cls.__qualname__}"

    @property
    def log(self) -> logging.Logger:
        """The Airflow trigger's own logger (``LoggingMixin.log``)."""
        log: logging.Logger = self.airflow_trigger.log
        return log


def _shared_stream_key(trigger: Any) -> Any:
    """The trigger's shared-stream key, or None to run it on its own: not an event trigger,
    no key, a key that cannot be read (as Airflow falls back), or ack mode."""
    key_of = getattr(trigger, "shared_stream_key", None)
    if key_of is None or not hasattr(trigger, "filter_shared_stream"):
        return None
    try:
        key = key_of()
    except Exception:
        logger.warning(
            "shared_stream_key() of %s raised; running it on its own",
            type(trigger).__qualname__,
            exc_info=True,
        )
        return None
    if key is None:
        return None
    base = next((c for c in type(trigger).__mro__ if c.__name__ == "BaseEventTrigger"), None)
    if base is not None and _function(type(trigger)) is not _function(base):
        return None  # ack mode: its producer advances the broker, not run here
    return key


def _function(cls: type) -> Any:
    """The function behind ``cls.create_shared_stream_producer`` (a classmethod: each
    lookup makes a new bound method)."""
    method = getattr(cls, "create_shared_stream_producer", None)
    return getattr(method, "__func__", method)


_MASKERS = (
    "airflow.sdk._shared.secrets_masker",  # Airflow 3: what mask_secret() and the SDK feed
    "airflow.utils.log.secrets_masker",  # Airflow 2.10
)


def redact_secrets(text: str) -> str:
    """``text`` with every secret Airflow's masker knows in this process replaced by
    ``***``, as Airflow masks its log lines (a connection's password, what a trigger gave
    ``mask_secret``); unchanged where no Airflow was loaded (nothing registers secrets)."""
    for name in _MASKERS:
        masker = sys.modules.get(name)
        if masker is not None:
            return str(masker.redact(text))
    return text


def watch_assets(trigger: BaseTrigger, assets: Sequence[tuple[str, str]]) -> None:
    """Give an Airflow event trigger the assets it watches, ``(name, uri)`` each, as its
    ``asset_state_store`` (Airflow's triggerer does so before ``run()``); nothing for any
    other trigger, nor on an Airflow without the store (before 3.3)."""
    if not assets or not isinstance(trigger, AirflowTrigger):
        return
    inner = trigger.airflow_trigger
    if not hasattr(inner, "asset_state_store"):
        return
    asset: Any = importlib.import_module("airflow.sdk.definitions.asset")
    context: Any = importlib.import_module("airflow.sdk.execution_time.context")
    inlets = [asset.Asset(name=name, uri=uri) for name, uri in assets]
    inner.asset_state_store = context.AssetStateStoreAccessors(inlets=inlets)


_IMPORTS_FROM_KWARGS: dict[str, tuple[str, ...]] = {
    # Airflow's deadline-alert callbacks: the trigger imports and awaits callback_path.
    "airflow.triggers.callback.CallbackTrigger": ("callback_path",),
}


@functools.cache
def airflow_trigger_class(airflow_class: type) -> type[AirflowTrigger]:
    """The deferline trigger class that runs ``airflow_class`` (one per Airflow class).

    It carries the Airflow class's module and name, so logs and metrics name the trigger the
    user wrote. Installs the database guard the first time.
    """
    if not is_airflow_trigger_class(airflow_class):
        raise TypeError(f"{airflow_class!r} is not an Airflow BaseTrigger subclass")
    _stand_in_for_airflow_services()
    namespace = {
        "airflow_class": airflow_class,
        "airflow_timer": _runs_as_timer(airflow_class),
        "imports_from_kwargs": _IMPORTS_FROM_KWARGS.get(
            f"{airflow_class.__module__}.{airflow_class.__qualname__}", ()
        ),
        "__module__": airflow_class.__module__,
        "__qualname__": airflow_class.__qualname__,
        "__doc__": airflow_class.__doc__,
    }
    adapter: type[AirflowTrigger] = type(airflow_class.__name__, (AirflowTrigger,), namespace)
    return adapter
