"""Turn a request's classpath and kwargs into a trigger, importing only what is allowed.

Whoever can write to the defer topic must not get arbitrary imports: a classpath is
imported only when it lies under an allowed module prefix, and only ``BaseTrigger``
subclasses are instantiated. Kwargs arrive already decrypted (see ``KwargsCipher``).

Subclasses of Apache Airflow's ``BaseTrigger`` (under ``airflow.…`` or any other allowed
prefix) are accepted too when Airflow is installed: they run through the adapter of
``_airflow.py``. Airflow itself is imported only by the allowed module that needs it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from ._airflow import (
    airflow_trigger_class,
    is_airflow_trigger_class,
    prepare_airflow_import,
)
from ._errors import TriggerImportError, TriggerKwargsError, TriggerLoadError, TriggerNotAllowed
from ._trigger import BaseTrigger

__all__ = ["is_allowed", "load_trigger", "resolve_trigger_class"]

_CLASSPATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def is_allowed(classpath: str, allowed_prefixes: Sequence[str]) -> bool:
    """True when ``classpath`` is a prefix itself or lies under one at a dotted boundary.

    ``"a.b"`` allows ``"a.b.C"`` and ``"a.b.c.D"`` but not ``"a.bc.D"``.
    """
    for prefix in allowed_prefixes:
        prefix = prefix.strip().rstrip(".")
        if prefix and (classpath == prefix or classpath.startswith(prefix + ".")):
            return True
    return False


def resolve_trigger_class(classpath: str, *, allowed_prefixes: Sequence[str]) -> type[BaseTrigger]:
    """Import and check the trigger class named by ``classpath``.

    Raises :class:`TriggerNotAllowed` (outside the prefixes, or not a BaseTrigger
    subclass), :class:`TriggerImportError` (malformed path, module or class missing, or
    the module failed to import) or :class:`TriggerLoadError` (abstract class).
    """
    if not isinstance(classpath, str) or not _CLASSPATH.match(classpath):
        raise TriggerImportError(
            f"{classpath!r} is not a dotted 'module.Class' path", classpath=str(classpath)
        )
    if isinstance(allowed_prefixes, str):
        raise TypeError("allowed_prefixes must be a sequence of prefixes, not one string")
    if not is_allowed(classpath, allowed_prefixes):
        raise TriggerNotAllowed(
            f"trigger class {classpath} is not under an allowed module prefix "
            f"(allowed: {', '.join(allowed_prefixes) or 'none'})",
            classpath=classpath,
        )
    module_name, _, class_name = classpath.rpartition(".")
    prepare_airflow_import()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = ""
        missing = getattr(exc, "name", None) or ""
        if missing == "airflow" or missing.startswith("airflow."):
            hint = (
                " (Airflow's triggers need apache-airflow and the provider package that holds"
                " them; pip install 'deferline[airflow]' installs Airflow 3 with its standard"
                " and HTTP providers, 'deferline[airflow2]' Airflow 2.10)"
            )
        raise TriggerImportError(
            f"cannot import module {module_name} of trigger {classpath}: {exc}{hint}",
            classpath=classpath,
        ) from exc
    except Exception as exc:  # the module itself raised while importing
        raise TriggerImportError(
            f"importing module {module_name} of trigger {classpath} raised "
            f"{type(exc).__name__}: {exc}",
            classpath=classpath,
        ) from exc
    try:
        cls = getattr(module, class_name)
    except AttributeError as exc:
        raise TriggerImportError(
            f"module {module_name} has no attribute {class_name}", classpath=classpath
        ) from exc
    from_airflow = (
        isinstance(cls, type) and not issubclass(cls, BaseTrigger) and is_airflow_trigger_class(cls)
    )
    if not from_airflow and (not isinstance(cls, type) or not issubclass(cls, BaseTrigger)):
        raise TriggerNotAllowed(
            f"{classpath} is not a subclass of deferline.engine.BaseTrigger "
            "(nor of Airflow's airflow.triggers.base.BaseTrigger)",
            classpath=classpath,
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise TriggerLoadError(
            f"trigger class {classpath} is abstract (does not implement {missing})",
            classpath=classpath,
        )
    return airflow_trigger_class(cls) if from_airflow else cls


def load_trigger(
    classpath: str,
    kwargs: Mapping[str, Any],
    *,
    allowed_prefixes: Sequence[str],
    classes: MutableMapping[str, type[BaseTrigger]] | None = None,
) -> BaseTrigger:
    """Build the trigger a request names; every failure is a :class:`TriggerLoadError`.

    ``kwargs`` must already be decrypted. A ``TypeError`` or ``ValueError`` (or any other
    exception) from the class's ``__init__`` becomes :class:`TriggerKwargsError`.

    ``classes`` caches resolved classes by classpath for a caller whose ``allowed_prefixes``
    never change (a triggerer lane): resolving (allowlist, import lookup, checks) costs more
    than building a simple trigger, and a rebuild resolves the same few classpaths tens of
    thousands of times. Only successes are cached; a refused classpath is checked each time.
    """
    cls = None if classes is None else classes.get(classpath)
    if cls is None:
        cls = resolve_trigger_class(classpath, allowed_prefixes=allowed_prefixes)
        if classes is not None:
            classes[classpath] = cls
    if not isinstance(kwargs, Mapping):
        raise TriggerKwargsError(
            f"kwargs of {classpath} must be a mapping, got {type(kwargs).__name__}",
            classpath=classpath,
        )
    for name in getattr(cls, "imports_from_kwargs", ()):
        # A trigger that imports what a kwarg names (Airflow's CallbackTrigger runs the
        # callback at callback_path) imports only what the prefixes allow, as the loader.
        path = kwargs.get(name)
        if not isinstance(path, str) or not is_allowed(path, allowed_prefixes):
            raise TriggerNotAllowed(
                f"{classpath} would import {name}={path!r}, which is not under an allowed "
                f"module prefix (allowed: {', '.join(allowed_prefixes) or 'none'})",
                classpath=classpath,
            )
    bad_keys = [key for key in kwargs if not isinstance(key, str) or not key.isidentifier()]
    if bad_keys:
        raise TriggerKwargsError(
            f"kwargs of {classpath} have keys that are not argument names: {bad_keys!r}",
            classpath=classpath,
        )
    try:
        trigger = cls(**kwargs)
    except Exception as exc:
        raise TriggerKwargsError(
            f"{classpath} rejected its kwargs: {type(exc).__name__}: {exc}", classpath=classpath
        ) from exc
    return trigger
