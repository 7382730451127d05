"""deferline's triggers as Airflow trigger classes, for what takes only Airflow's: an
``AssetWatcher`` (Airflow 3) takes a subclass of Airflow's ``BaseEventTrigger``.

Importing this module imports Airflow. In deferline's triggerer such a class runs its
deferline form (:meth:`KafkaWatchTrigger.deferline_trigger`: events named after their
record, offsets committed by the publisher); in ``airflow triggerer`` its ``run()`` runs
there as any Airflow trigger, committing each offset once the event is handed over.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from airflow.triggers.base import BaseEventTrigger
from airflow.triggers.base import TriggerEvent as AirflowTriggerEvent

from ._kafka_watch import KafkaWatchTrigger as _KafkaWatch

__all__ = ["KafkaWatchTrigger"]


class KafkaWatchTrigger(BaseEventTrigger):  # type: ignore[misc]
    """Airflow's face of :class:`deferline.engine.triggers.KafkaWatchTrigger`: same
    arguments, same events; for ``AssetWatcher(name, trigger=KafkaWatchTrigger(...))``."""

    def __init__(
        self, topic: str, group: str, match: Mapping[str, Any] | None = None, **options: Any
    ) -> None:
        """The arguments of deferline's ``KafkaWatchTrigger`` (``key``, ``value_regex``,
        ``start``, ``consumer_config``, ``poll_timeout``), checked here, where the DAG is
        parsed."""
        super().__init__()
        self._watch = _KafkaWatch(topic, group, match, **options)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.{type(self).__qualname__}", self._watch.serialize()[1]

    def deferline_trigger(self) -> _KafkaWatch:
        """What deferline's triggerer runs instead of :meth:`run`."""
        watch = _KafkaWatch(**self.serialize()[1])
        watch.trigger_id = self.trigger_id
        return watch

    async def run(self) -> AsyncIterator[AirflowTriggerEvent]:
        watch = _KafkaWatch(**self.serialize()[1])
        watch.commits_offsets = True
        async for event in watch.run():
            yield AirflowTriggerEvent(event.payload)
