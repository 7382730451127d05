"""Local state of the runners: where checkpoints live and how their databases are opened.

The triggerer keeps one rocksdict database per owned partition, the scheduler one per
scheduler group. RocksDB locks a database for the process that opened it, so two processes
on one host need distinct directories; :func:`open_rocks` names that case in its error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from deferline.schemas import DeferlineError

__all__ = ["CheckpointError", "CheckpointInUse", "open_rocks", "state_home"]

_WRITE_BUFFER = 4 << 20


class CheckpointError(DeferlineError):
    """A checkpoint could not be opened, read or written."""


class CheckpointInUse(CheckpointError):
    """Another live process holds the checkpoint open (RocksDB's lock)."""


def state_home() -> Path:
    """``$XDG_STATE_HOME/deferline`` (``~/.local/state/deferline`` when unset)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "deferline"


def open_rocks(path: Path) -> Any:
    """Open (create) the rocksdict database at ``path`` in raw mode (bytes keys and values)."""
    from rocksdict import Options, Rdict

    options = Options(raw_mode=True)
    options.create_if_missing(True)
    # RocksDB's default memtable is 64 MB per database (and up to two of them): a
    # checkpoint writes a few MB at a time, so a small one saves memory at no cost.
    options.set_write_buffer_size(_WRITE_BUFFER)
    options.set_max_write_buffer_number(2)
    try:
        path.mkdir(parents=True, exist_ok=True)
        return Rdict(str(path), options)
    except Exception as exc:  # rocksdict raises a bare Exception (lock, corruption)
        if "lock" in str(exc).lower():
            raise CheckpointInUse(f"checkpoint {path} is in use by another process: {exc}") from exc
        raise CheckpointError(f"cannot open checkpoint {path}: {exc}") from exc
