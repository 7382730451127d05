"""The bridges and deferline triggerers an Airflow deployment test starts, and what it waits
for and reads in Airflow's database meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path

from deferline.topics import Settings

from tests._until import until

from ._airflow_deployment import AirflowDeployment
from ._process import DeferlineProcess

__all__ = ["Processes", "reach", "run_id_of", "trigger_dag", "xcom"]


class Processes:
    """The bridges and deferline triggerers one test starts, on its prefix or on a prefix
    under it, each with the deployment's environment unless given one; killed at its end."""

    def __init__(self, settings: Settings, af: AirflowDeployment, workdir: Path) -> None:
        self.settings, self.af, self.workdir = settings, af, workdir
        self._started: list[DeferlineProcess] = []

    def prefix(self, under: str = "") -> str:
        return f"{self.settings.topic_prefix}{under}"

    def bridge(
        self, name: str, *args: str, under: str = "", env: Mapping[str, str] | None = None
    ) -> DeferlineProcess:
        return self._start(
            ("airflow", "bridge"),
            name,
            under,
            env,
            "--bridge-prefix",
            self.prefix(under),
            "--poll-interval",
            "0.5",
            *args,
        )

    def triggerer(
        self, name: str, *args: str, under: str = "", env: Mapping[str, str] | None = None
    ) -> DeferlineProcess:
        state = str(self.workdir / name)
        return self._start(
            "triggerer", name, under, env, "--member", name, "--state-dir", state, *args
        )

    def _start(
        self,
        command: str | tuple[str, ...],
        name: str,
        under: str,
        env: Mapping[str, str] | None,
        *args: str,
    ) -> DeferlineProcess:
        settings = self.settings.model_copy(update={"topic_prefix": self.prefix(under)})
        process = DeferlineProcess(
            settings,
            command,
            self.workdir / f"{name}.log",
            *args,
            "--log-format",
            "json",
            env=self.af.env if env is None else env,
        )
        self._started.append(process)
        return process

    def dead(self) -> list[str]:
        """The logs of the processes that have stopped by themselves."""
        return [str(p.log_path) for p in self._started if not p.alive]

    def close(self) -> None:
        for process in reversed(self._started):
            process.close()


async def trigger_dag(
    af: AirflowDeployment, dag_id: str, run_id: str, *, logical_date: str | None = None
) -> None:
    """``airflow dags trigger`` one run (of ``logical_date`` when given)."""
    option = "--logical-date" if af.line >= 3 else "--exec-date"
    dated = (option, logical_date) if logical_date else ()
    await asyncio.to_thread(af.run, "dags", "trigger", dag_id, "--run-id", run_id, *dated)


def run_id_of(settings: Settings, name: str) -> str:
    """A DAG run of this test only (the deployment serves every test of the module)."""
    return f"{name}-{settings.topic_prefix.rstrip('.')}"


async def reach(
    af: AirflowDeployment, dag_id: str, run_id: str, tasks: set[str], wanted: str | set[str]
) -> None:
    """Wait until each of ``tasks`` is in state ``wanted`` (or in one of them)."""
    states_wanted = {wanted} if isinstance(wanted, str) else wanted

    def check() -> bool:
        states = af.states(dag_id, run_id)
        return set(states) >= tasks and all(states[t] in states_wanted for t in tasks)

    await until(
        partial(asyncio.to_thread, check),
        within=240,
        interval=0.5,
        what=f"{dag_id} {sorted(tasks)} {sorted(states_wanted)}",
    )


def xcom(af: AirflowDeployment, dag_id: str, run_id: str, task_id: str, key: str) -> object:
    """An XCom's value as Airflow's ``XComModel.deserialize_value`` reads it: JSON in a JSON
    column, once more JSON when pushed with ``XComModel.set`` (as a trigger's are)."""
    rows = af.query(
        "SELECT value FROM xcom WHERE dag_id = ? AND run_id = ? AND task_id = ? AND key = ?",
        dag_id,
        run_id,
        task_id,
        key,
    )
    assert len(rows) == 1, (task_id, key, rows)
    value = json.loads(str(rows[0][0]))
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return json.loads(value)
    return value
