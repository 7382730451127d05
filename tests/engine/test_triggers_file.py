"""FileTrigger: glob matching, directory semantics, and globbing off the event loop."""

from __future__ import annotations

import asyncio
import glob
import threading
from pathlib import Path

import pytest
from deferline.engine import TriggerEvent
from deferline.engine.triggers import FileTrigger
from deferline.engine.triggers.testing import find_file

from ._support import first_event


def test_find_file(tmp_path: Path) -> None:
    assert find_file(str(tmp_path / "*.csv"), False) is None
    (tmp_path / "b.csv").write_text("x")
    (tmp_path / "a.csv").write_text("x")
    assert find_file(str(tmp_path / "*.csv"), False) == str(tmp_path / "a.csv")
    nested = tmp_path / "deep" / "er"
    nested.mkdir(parents=True)
    (nested / "part-0.parquet").write_text("x")
    assert find_file(str(tmp_path / "**" / "*.parquet"), False) is None
    assert find_file(str(tmp_path / "**" / "*.parquet"), True) == str(nested / "part-0.parquet")
    # A matching directory counts when it holds a file at any depth.
    assert find_file(str(tmp_path / "deep"), False) == str(nested / "part-0.parquet")
    (tmp_path / "empty").mkdir()
    assert find_file(str(tmp_path / "empty"), False) is None


def test_validation_and_serialize() -> None:
    trigger = FileTrigger("/in/*.csv", poll_interval=0.5)
    assert trigger.serialize() == (
        "deferline.engine.triggers.FileTrigger",
        {"filepath": "/in/*.csv", "recursive": False, "poll_interval": 0.5},
    )
    assert FileTrigger("/x", poke_interval=2).poll_interval == 2.0  # Airflow's name
    with pytest.raises(ValueError, match="filepath must not be empty"):
        FileTrigger("")
    with pytest.raises(ValueError, match="poll_interval must be > 0"):
        FileTrigger("/x", poll_interval=0)
    with pytest.raises(TypeError, match="recursive"):
        FileTrigger("/x", recursive="yes")  # type: ignore[arg-type]


async def test_fires_when_the_file_appears_and_globs_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    polled = asyncio.Event()
    loop = asyncio.get_running_loop()
    real_glob = glob.glob

    def spy(pattern: str, *, recursive: bool = False) -> list[str]:
        threads.append(threading.get_ident())
        loop.call_soon_threadsafe(polled.set)
        found: list[str] = real_glob(pattern, recursive=recursive)
        return found

    monkeypatch.setattr(glob, "glob", spy)
    trigger = FileTrigger(str(tmp_path / "ready-*.flag"), poll_interval=0.005)
    task = asyncio.create_task(first_event(trigger))
    await polled.wait()
    assert not task.done()
    (tmp_path / "ready-1.flag").write_text("")
    event = await asyncio.wait_for(task, 5)
    assert event == TriggerEvent(
        {"filepath": str(tmp_path / "ready-*.flag"), "path": str(tmp_path / "ready-1.flag")}
    )
    assert threads
    assert threading.get_ident() not in threads
