"""Triggers' own log lines in Airflow's UI: written where Airflow's log reader looks for them.

Airflow's triggerer writes the lines of each trigger to ``<task log path>.trigger.<triggerer
job id>.log`` under ``[logging] base_log_folder`` and serves that folder on ``[logging]
trigger_log_server_port`` (8794); while a task is deferred, the API server's log reader asks
the log server at the host of the task's triggerer job for that file, and once it resumed it
reads the files beside the task's log (or the remote copy). With ``--trigger-logs`` the bridge
does the same for the triggers of its rows: it reads the ``trigger.logs`` topic (the lines the
deferline triggerers ship), appends each line of a row it holds to that file under its own job
id, in Airflow's format (JSON lines on Airflow 3, its text format on 2.10), serves the folder
with Airflow's own log server, and uploads a row's file with Airflow's remote log handler
(when one is configured) once the row is done.

Every bridge reads every partition (a row's lines belong to the bridge holding the row), from
ten minutes back at its start: a bridge restarted meanwhile writes those lines again, into the
file of its new job id.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Final

from deferline.schemas import LogLine, TriggerLogRecord

from ._rows import RowRef, parse_trigger_id

__all__ = ["LOOK_BACK", "LogServer", "TriggerLogFiles"]

logger = logging.getLogger(__name__)

LOOK_BACK: Final = dt.timedelta(minutes=10)
"""How far back a starting bridge reads the ``trigger.logs`` topic."""


def json_line(line: LogLine) -> str:
    """A line as Airflow 3 writes a task's log: one JSON object."""
    stamp = line.at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return json.dumps(
        {"timestamp": stamp, "level": line.level, "event": line.message, "logger": line.logger},
        ensure_ascii=False,
    )


def text_line(line: LogLine) -> str:
    """A line as Airflow 2.10 writes a task's log: its text format."""
    stamp = line.at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f%z")
    return f"[{stamp}] {{{line.logger}}} {line.level.upper()} - {line.message}"


class TriggerLogFiles:
    """Appends the lines of the rows this bridge holds to their trigger log files.

    Owns ``_paths`` (each row's file, relative to the base log folder, found once through
    Airflow's log filename template). Synchronous: called from the bridge's database thread.
    """

    def __init__(
        self,
        *,
        base_folder: str,
        job_id: int,
        task_log_path: Callable[[int], str | None],
        holds: Callable[[RowRef], bool],
        airflow2: bool,
    ) -> None:
        self._base = Path(base_folder)
        self._job_id = job_id
        self._task_log_path = task_log_path
        self._holds = holds
        self._format = text_line if airflow2 else json_line
        self._paths: dict[RowRef, str | None] = {}

    def relative_path(self, ref: RowRef) -> str | None:
        """The row's trigger log file, relative to the base log folder (None: no task)."""
        if ref not in self._paths:
            task_path = self._task_log_path(ref.row_id)
            self._paths[ref] = (
                None if task_path is None else f"{task_path}.trigger.{self._job_id}.log"
            )
        return self._paths[ref]

    def write(self, records: Sequence[TriggerLogRecord]) -> int:
        """Append the lines of ``records`` whose rows this bridge holds; the lines written."""
        by_file: dict[Path, list[str]] = {}
        for record in records:
            ref = parse_trigger_id(record.trigger_id)
            if ref is None or not self._holds(ref):
                continue
            relative = self.relative_path(ref)
            if relative is None:
                continue
            lines = by_file.setdefault(self._base / relative, [])
            if record.dropped:
                lines.append(self._format(_dropped(record)))
            lines.extend(self._format(line) for line in record.lines)
        written = 0
        for path, lines in by_file.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as out:
                out.write("".join(f"{line}\n" for line in lines))
            written += len(lines)
        return written

    def done(self, row_ids: Collection[int]) -> list[str]:
        """These rows left this bridge (deleted once their trigger ended, or claimed by
        another triggerer): their files' relative paths (to upload), forgotten here. (Not at
        their event: a trigger's last lines come after it.)"""
        gone = [ref for ref in self._paths if ref.row_id in row_ids]
        return [path for ref in gone if (path := self._paths.pop(ref)) is not None]


def _dropped(record: TriggerLogRecord) -> LogLine:
    first = record.lines[0].at if record.lines else dt.datetime.now(dt.UTC)
    return LogLine(
        at=first,
        level="warning",
        logger="deferline",
        message=f"{record.dropped} log lines of this trigger were dropped: it logged faster "
        "than its triggerer ships lines (deferline_triggerer_trigger_log_lines_dropped_total)",
    )


def upload_to_remote(relative_path: str) -> bool:
    """Upload one trigger log file with Airflow's remote log handler, as Airflow's triggerer
    does when a trigger ends; False when no remote handler is configured (or Airflow 2.10,
    whose triggerer uploads through its logging handlers)."""
    try:
        sdk_log: Any = importlib.import_module("airflow.sdk.log")
    except ImportError:
        return False
    handler = sdk_log.load_remote_log_handler()
    if handler is None:
        return False
    handler.upload(relative_path, None)
    return True


class LogServer:
    """Airflow's own log server (``serve_logs``) in a child process, serving the base log
    folder on ``[logging] trigger_log_server_port``, as ``airflow triggerer`` starts it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        code = (
            "import importlib.util, sys\n"
            "name = 'airflow.utils.serve_logs.core'\n"
            "if importlib.util.find_spec('airflow.utils.serve_logs.core') is None:\n"
            "    name = 'airflow.utils.serve_logs'\n"  # Airflow 2.10
            "importlib.import_module(name).serve_logs(int(sys.argv[1]))\n"
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, str(self.port)], env=os.environ.copy()
        )
        logger.info("trigger log server started", extra={"port": self.port})

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
