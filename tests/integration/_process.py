"""Test helper: a ``deferline`` subprocess whose JSON log lines are captured to a file."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deferline.topics import Settings

DEFERLINE = str(Path(sys.executable).with_name("deferline"))


class DeferlineProcess:
    """``deferline COMMAND`` against ``settings``' broker and prefix, logging JSON to a file."""

    def __init__(
        self,
        settings: Settings,
        command: str | tuple[str, ...],
        log_path: Path,
        *args: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.log_path = log_path
        argv = [
            DEFERLINE,
            *((command,) if isinstance(command, str) else command),
            "--bootstrap-servers",
            settings.bootstrap_servers,
            "--topic-prefix",
            settings.topic_prefix,
            *args,
        ]
        environ = {
            **(os.environ if env is None else env),
            "DEFERLINE_PARTITIONS": str(settings.partitions),
        }
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=environ)

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for raw in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(raw))
        return out

    def find(self, message: str) -> list[dict[str, Any]]:
        return [line for line in self.lines() if line.get("message", "").startswith(message)]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()
