"""``deferline demo`` (what ``make demo`` runs), smaller: it finishes and leaves no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests._until import until_sync

pytestmark = pytest.mark.integration

MARKER_ENV = "DEFERLINE_DEMO_RUN"


def demo_argv(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("deferline")
    return [str(script), "demo", *args]


def processes_of(marker: str) -> list[int]:
    """PIDs of live processes started by the demo run named ``marker`` (from /proc)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def wait_gone(marker: str, within: float = 15.0) -> None:
    """Wait until no process of the demo run ``marker`` is left; fail naming those that are."""
    until_sync(
        lambda: not processes_of(marker),
        within=within,
        interval=0.1,
        what=lambda: f"every demo process to exit ({processes_of(marker)} still running)",
    )


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_demo_runs_to_the_end_and_leaves_no_process(tmp_path: Path) -> None:
    marker = f"demo-test-{uuid.uuid4().hex[:8]}."
    summary_path = tmp_path / "summary.json"
    result = subprocess.run(
        demo_argv(
            "--tasks",
            "200",
            "--duration",
            "12",
            "--plain",
            "--topic-prefix",
            marker,
            "--summary-json",
            str(summary_path),
        ),
        capture_output=True,
        timeout=150,
        check=False,
    )
    output = result.stdout.decode(errors="replace") + result.stderr.decode(errors="replace")
    assert result.returncode == 0, output[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["finished"] == summary["tasks"] == 200
    assert summary["ok"] is True
    assert summary["unexpected"] == []
    assert summary["by_state"]["failed"] == summary["by_kind"]["timeout"][1], "timeouts fail"
    assert summary["failover"]["moved_after"] is not None, "the survivor took the partitions"
    assert summary["failover"]["partitions"], "the killed triggerer owned partitions"
    assert summary["worker_slot_seconds"] < summary["blocking_slot_seconds"]
    assert summary["elapsed_seconds"] < 120
    wait_gone(marker, within=5.0)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_demo_with_a_scheduler_killed_halfway_applies_nothing_twice(
    tmp_path: Path,
) -> None:
    marker = f"demo-test-{uuid.uuid4().hex[:8]}."
    summary_path = tmp_path / "summary.json"
    result = subprocess.run(
        demo_argv(
            *("--tasks", "200", "--duration", "12", "--plain", "--kill-scheduler"),
            *("--topic-prefix", marker, "--summary-json", str(summary_path)),
        ),
        capture_output=True,
        timeout=150,
        check=False,
    )
    output = result.stdout.decode(errors="replace") + result.stderr.decode(errors="replace")
    assert "and scheduler" in output, "a scheduler (the one owning most partitions) was SIGKILLed"
    summary = json.loads(summary_path.read_text())
    assert result.returncode == 0, output[-4000:]
    assert summary["finished"] == summary["tasks"] == 200, summary["by_state"]
    assert summary["ok"] is True
    assert summary["unexpected"] == []
    # Without transactions (the embedded broker) the new owner re-sends the RunTask of a task
    # left `queued` on an event it reads again; a copy whose original did go out reaches the
    # worker, which ignores it. Any other RunTask reaching a worker twice fails here.
    assert summary["worker_duplicate_runs"] <= summary["runs_resent"], summary
    wait_gone(marker, within=5.0)


def _interruptible() -> None:
    """SIGINT as a terminal leaves it to the demo: a suite started as a background job of a
    shell runs with SIGINT ignored, which every child inherits (the demo then finished on
    its own, or not within the timeout)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_interrupted_demo_leaves_no_process() -> None:
    marker = f"demo-test-{uuid.uuid4().hex[:8]}."
    demo = subprocess.Popen(
        demo_argv("--tasks", "100", "--duration", "30", "--plain", "--topic-prefix", marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=_interruptible,
    )
    try:
        assert demo.stdout is not None
        # Wait until the tasks are submitted and the run is under way (first progress line).
        for raw in demo.stdout:
            if b"finished" in raw:
                break
        else:
            pytest.fail("the demo ended before it was under way")
        assert len(processes_of(marker)) == 5, "broker, two triggerers, scheduler, worker"
        demo.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal does
        demo.communicate(timeout=30)
        assert demo.returncode == 130
        wait_gone(marker)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        if demo.stdout is not None:
            demo.stdout.close()  # read to its end only when the demo stopped as asked
