"""Airflow's logging with a remote log store in a local folder (``REMOTE_LOG_FOLDER``): what
S3 or GCS would be, for the trigger-logs test (``[logging] logging_config_class``)."""

# mypy: ignore-errors
from __future__ import annotations

import os
import shutil
from copy import deepcopy
from pathlib import Path

from airflow.config_templates.airflow_local_settings import BASE_LOG_FOLDER, DEFAULT_LOGGING_CONFIG

LOGGING_CONFIG = deepcopy(DEFAULT_LOGGING_CONFIG)


class FolderRemoteLogIO:
    """Airflow's RemoteLogIO over a folder: ``upload`` copies a log there, ``read`` reads a
    task's log and the files beside it (its trigger logs) back."""

    processors = ()

    def __init__(self, base: str, remote: str) -> None:
        self.base, self.remote = Path(base), Path(remote)

    def upload(self, path, ti=None) -> None:
        relative = Path(path)
        if relative.is_absolute():
            relative = relative.relative_to(self.base)
        target = self.remote / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.base / relative, target)

    def read(self, relative_path, ti):
        found = sorted((self.remote / relative_path).parent.glob(Path(relative_path).name + "*"))
        return [str(p) for p in found], [p.read_text() for p in found]


REMOTE_TASK_LOG = FolderRemoteLogIO(BASE_LOG_FOLDER, os.environ["REMOTE_LOG_FOLDER"])
