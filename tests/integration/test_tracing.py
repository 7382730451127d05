"""One deferral, one trace: worker, triggerer and scheduler spans joined by record headers."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from deferline.client import Client
from deferline.runners.scheduler import Scheduler
from deferline.runners.worker import Worker
from deferline.topics import Settings, disable_tracing, enable_tracing
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.integration._taskflow import TaskFlow
from tests.integration.test_replay_system import EXAMPLES, allowed, submit, triggerer


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    enable_tracing(provider)
    try:
        yield exporter
    finally:
        disable_tracing()
        provider.shutdown()


@pytest.mark.integration
async def test_one_deferral_is_one_connected_trace(
    settings: Settings, exported: InMemorySpanExporter
):
    runs = allowed(settings)
    async with (
        TaskFlow(runs) as flow,
        Scheduler(runs, orphan_check_interval=0.5, commit_interval=0.2) as scheduler,
        Worker(runs, slots=2, poll_interval=0.02, graceful_timeout=5.0),
        triggerer(runs, "trace-trig"),
        Client(runs) as client,
    ):
        await scheduler.wait_active()
        task = await submit(client, "traced", f"{EXAMPLES}.WaitOperator", seconds=0.1)
        deferred = await flow.wait_passed(task, "deferred")
        await flow.wait_state(task, "success")

    spans: list[ReadableSpan] = [
        s
        for s in exported.get_finished_spans()
        if s.attributes and s.attributes.get("deferline.trigger_id") == deferred.trigger_id
    ]
    spans.sort(key=lambda s: s.start_time or 0)
    assert [(s.attributes or {}).get("deferline.stage") for s in spans] == [
        "defer",  # worker: send the DeferRequest
        "run",  # triggerer: receive it
        "emit",  # triggerer: send the event (resume topic)
        "emit",  # triggerer: send its copy (tasks.events)
        "apply",  # scheduler: receive the copy
        "resume",  # scheduler: send the RunTask
        "resume",  # worker: receive it
    ]
    assert [s.name.split()[0] for s in spans] == [
        "send", "process", "send", "send", "process", "send", "process"
    ]  # fmt: skip
    assert [(s.attributes or {}).get("messaging.destination.name") for s in spans[2:5]] == [
        f"{settings.topic_prefix}resume",
        f"{settings.topic_prefix}tasks.events",
        f"{settings.topic_prefix}tasks.events",
    ]
    assert len({s.context.trace_id for s in spans if s.context}) == 1
    assert spans[0].parent is None
    for parent, child in itertools.pairwise(spans):
        assert child.parent is not None
        assert parent.context is not None
        assert child.parent.span_id == parent.context.span_id, child.name
    first = spans[0].attributes or {}
    assert first["messaging.system"] == "kafka"
    assert first["messaging.destination.name"] == f"{settings.topic_prefix}defer"
    assert first["deferline.task"] == task.ti_key


def test_without_otel_variables_nothing_of_opentelemetry_is_imported():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = (
        "import sys\n"
        "import deferline.runners.scheduler, deferline.runners.triggerer\n"
        "import deferline.runners.worker\n"
        "from deferline.topics import trace_receive, trace_send\n"
        'value = b\'{"kind": "defer_request", "trigger_id": "t"}\'\n'
        "assert trace_send('p.defer', value) == []\n"
        "parent = b'00-' + b'1' * 32 + b'-' + b'2' * 16 + b'-01'\n"
        "trace_receive('p.defer', value, [('traceparent', parent)])\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
