"""``start_from_trigger`` kwargs rendered as Airflow's triggerer renders them, before publishing.

A task with ``start_from_trigger`` never runs on a worker before its trigger: Airflow's
scheduler writes the trigger row with the operator's ``start_trigger_args`` as they are in the
serialized DAG, templates included (``DateTimeSensorAsync``'s ``target_time`` as
``"{{ macros.ds_add(ds, 1) }}"``). Airflow's triggerer renders them just before ``run()``: the
task from the serialized DAG, a ``RuntimeTaskInstance`` from it and the DAG run
(``TriggerRunner.create_runtime_ti``), its template context, then the trigger's
``render_template_fields`` (only the operator's templated fields that are also trigger
kwargs). :class:`StartFromTriggerRendering` does the same in the bridge, with the same Airflow
code, and the rendered trigger's ``serialize()`` is what the DeferRequest carries. A template
that reads a variable or a connection (``var``, ``conn``) reads Airflow's database: the bridge
runs as one of Airflow's server processes (``_AIRFLOW_PROCESS_CONTEXT=server``), whose
secrets search path ends with the metastore, as Airflow's triggerer's supervisor's does.

Only rows whose kwargs hold a Jinja marker are looked at (a worker's deferral carries kwargs
its operator already rendered; rendering text without markers changes nothing), so a burst of
ordinary deferrals costs no DAG load. Airflow 3 only.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from ._rows import KwargsNotRendered

__all__ = ["StartFromTriggerRendering", "has_template"]

_MARKERS = ("{{", "{%", "{#")


def has_template(value: Any) -> bool:
    """True when ``value`` (kwargs, nested) holds text with a Jinja marker."""
    if isinstance(value, str):
        return any(marker in value for marker in _MARKERS)
    if isinstance(value, Mapping):
        return any(has_template(v) for v in value.values())
    if isinstance(value, list | tuple | set | frozenset):
        return any(has_template(v) for v in value)
    return False


class StartFromTriggerRendering:
    """Renders the templated kwargs of ``start_from_trigger`` rows, as Airflow's triggerer."""

    def __init__(self) -> None:
        self._dag_bag: Any = importlib.import_module("airflow.models.dagbag").DBDagBag()
        self._ti_dto: Any = importlib.import_module(
            "airflow.executors.workloads.task"
        ).TaskInstanceDTO
        runner: Any = importlib.import_module("airflow.jobs.triggerer_job_runner")
        self._create_runtime_ti: Any = runner.TriggerRunner.create_runtime_ti
        self._decode_kwarg: Any = importlib.import_module(
            "airflow.serialization.decoders"
        ).smart_decode_trigger_kwargs
        self._import_string: Any = importlib.import_module(
            "airflow._shared.module_loading"
        ).import_string
        self._ti_model: Any = importlib.import_module("airflow.models.taskinstance").TaskInstance
        self._sa: Any = importlib.import_module("sqlalchemy")

    def render(
        self, session: Any, classpath: str, kwargs: Mapping[str, Any], task: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The kwargs to publish for one row: rendered when its task starts from its trigger,
        else as they are. ``task`` names the task instance (dag_id, task_id, run_id,
        map_index). Raises :class:`KwargsNotRendered` saying why."""
        ti_model = self._ti_model
        ti = session.scalar(
            self._sa.select(ti_model).where(*(getattr(ti_model, k) == v for k, v in task.items()))
        )
        if ti is None or ti.dag_version_id is None:
            return dict(kwargs)
        dag_run = ti.get_dagrun(session=session)
        serialized = self._dag_bag.get_serialized_dag_model_for_run(
            dag_run, session=session
        ) or self._dag_bag.get_serialized_dag_model(version_id=ti.dag_version_id, session=session)
        if serialized is None:
            return dict(kwargs)
        try:
            operator = serialized.dag.get_task(ti.task_id)
        except Exception:  # TaskNotFound: Airflow's triggerer builds a plain workload then
            return dict(kwargs)
        if not getattr(operator, "start_from_trigger", False):
            return dict(kwargs)
        try:
            runtime_ti = self._create_runtime_ti(
                self._ti_dto.model_validate(ti, from_attributes=True),
                serialized.data,
                dag_run.dag_run_data.model_dump(exclude_unset=True),
            )
            trigger_class = self._import_string(classpath)
            trigger = trigger_class(**{k: self._decode_kwarg(v) for k, v in kwargs.items()})
            trigger.task_instance = runtime_ti
            context = runtime_ti.get_template_context()
            trigger.render_template_fields(context=context)
            _, rendered = trigger.serialize()
        except Exception as exc:
            raise KwargsNotRendered(f"{type(exc).__name__}: {exc}") from exc
        return dict(rendered)
