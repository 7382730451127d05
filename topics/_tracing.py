"""Traces across processes: W3C trace context in Kafka record headers (``deferline[otel]``).

One trace per deferral, seven spans over four process roles: the worker's ``defer`` (it sends
the DeferRequest), the triggerer's ``run`` (it receives it) and two ``emit`` (it sends the
event to the resume topic, then its copy to tasks.events), the scheduler's ``apply`` (it
receives the copy) and ``resume`` (it sends the RunTask), the worker's ``resume`` (it
receives the RunTask). A receipt continues the context
of the record's ``traceparent`` header; a send continues the context this process last
received for the same trigger id, and writes its own into the record's headers. Spans follow
OpenTelemetry's messaging conventions (``send <topic>`` / ``process <topic>``, kind PRODUCER /
CONSUMER, ``messaging.*`` attributes) plus ``deferline.stage``, ``deferline.trigger_id`` and
``deferline.task``.

Off unless the usual ``OTEL_*`` variables ask for traces (``OTEL_TRACES_EXPORTER`` other than
``none``, or an OTLP endpoint), or :func:`enable_tracing` is given a tracer provider: only
then is opentelemetry imported. Off, :func:`trace_send` and :func:`trace_receive` return at
their first test.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import orjson

__all__ = ["disable_tracing", "enable_tracing", "trace_receive", "trace_send", "tracing_on"]

logger = logging.getLogger(__name__)

Headers = Sequence[tuple[str, bytes]]

_NO_HEADERS: list[tuple[str, bytes]] = []
"""Shared by every untraced record (aiokafka's record builder wants a list; nobody mutates it)."""
_REMEMBERED = 100_000
"""Trigger ids whose last received context a process keeps (oldest forgotten first)."""

_KIND_BYTES = (b'"defer_request"', b'"trigger_event"', b'"run_task"')

_STAGES = {
    ("defer_request", True): "defer",
    ("defer_request", False): "run",
    ("trigger_event", True): "emit",
    ("trigger_event", False): "apply",
    ("run_task", True): "resume",
    ("run_task", False): "resume",
}


def _subject(value: bytes | None) -> tuple[str, str, str] | None:
    """(kind, trigger id, task key) of a traced record: a DeferRequest, an event, a resume."""
    if not value or not any(kind in value for kind in _KIND_BYTES):
        return None  # a task state, a dead letter...: not parsed
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    kind, trigger_id = data.get("kind"), data.get("trigger_id")
    if kind not in ("defer_request", "trigger_event", "run_task") or not isinstance(
        trigger_id, str
    ):
        return None
    if kind == "run_task" and data.get("mode") != "resume":
        return None
    task = data.get("task")
    ti_key = (
        "/".join(str(task.get(k, "")) for k in ("dag_id", "task_id", "run_id", "map_index"))
        if isinstance(task, dict)
        else ""
    )
    return str(kind), trigger_id, ti_key


class _Tracing:
    """The tracer and the contexts last received per trigger id."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._context = context
        self._tracer = provider.get_tracer("deferline")
        self._w3c = TraceContextTextMapPropagator()
        self._last: OrderedDict[str, Any] = OrderedDict()

    def _attributes(
        self, topic: str, operation: str, stage: str, subject: tuple[str, str, str]
    ) -> dict[str, str]:
        return {
            "messaging.system": "kafka",
            "messaging.destination.name": topic,
            "messaging.operation.name": operation,
            "messaging.operation.type": operation,
            "messaging.kafka.message.key": subject[1],
            "deferline.stage": stage,
            "deferline.trigger_id": subject[1],
            "deferline.task": subject[2],
        }

    def _remember(self, trigger_id: str, ctx: Any) -> None:
        self._last[trigger_id] = ctx
        self._last.move_to_end(trigger_id)
        if len(self._last) > _REMEMBERED:
            self._last.popitem(last=False)

    def send(self, topic: str, value: bytes | None) -> list[tuple[str, bytes]]:
        subject = _subject(value)
        if subject is None:
            return _NO_HEADERS
        parent = self._last.get(subject[1]) or self._context.Context()
        span = self._tracer.start_span(
            f"send {topic}",
            context=parent,
            kind=self._trace.SpanKind.PRODUCER,
            attributes=self._attributes(topic, "send", _STAGES[subject[0], True], subject),
        )
        span.end()
        ctx = self._trace.set_span_in_context(span)
        carrier: dict[str, str] = {}
        self._w3c.inject(carrier, context=ctx)
        self._remember(subject[1], ctx)
        return [(k, v.encode()) for k, v in carrier.items()]

    def receive(self, topic: str, value: bytes | None, headers: Headers | None) -> None:
        subject = _subject(value)
        if subject is None:
            return
        carrier = {k: v.decode("latin-1") for k, v in headers or () if k in _W3C_KEYS}
        span = self._tracer.start_span(
            f"process {topic}",
            context=self._w3c.extract(carrier),
            kind=self._trace.SpanKind.CONSUMER,
            attributes=self._attributes(topic, "process", _STAGES[subject[0], False], subject),
        )
        span.end()
        self._remember(subject[1], self._trace.set_span_in_context(span))


_W3C_KEYS = frozenset({"traceparent", "tracestate"})


class _Switch:
    """Whether tracing is on in this process: decided once, from the environment."""

    def __init__(self) -> None:
        self.decided = False
        self.tracing: _Tracing | None = None

    def get(self) -> _Tracing | None:
        if not self.decided:
            self.tracing = _from_environment()
            self.decided = True
        return self.tracing


_SWITCH = _Switch()


def _from_environment() -> _Tracing | None:
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if exporter == "none" or (not exporter and not endpoint):
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )

        span_exporter: SpanExporter
        if exporter == "console":
            span_exporter = ConsoleSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            span_exporter = OTLPSpanExporter()
    except ImportError as exc:
        logger.warning("OTEL_* variables ask for traces; install deferline[otel] (%s)", exc)
        return None
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # none configured by the application
        provider = TracerProvider()  # its resource reads OTEL_SERVICE_NAME and friends
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
        trace.set_tracer_provider(provider)
    return _Tracing(provider)


def enable_tracing(provider: Any) -> None:
    """Trace with this OpenTelemetry ``TracerProvider`` (whatever the environment says)."""
    _SWITCH.tracing, _SWITCH.decided = _Tracing(provider), True


def disable_tracing() -> None:
    """Stop tracing in this process."""
    _SWITCH.tracing, _SWITCH.decided = None, True


def tracing_on() -> bool:
    """Is this process tracing? (A caller with a whole batch asks once, not per record.)"""
    return (_SWITCH.tracing if _SWITCH.decided else _SWITCH.get()) is not None


def trace_send(topic: str, value: bytes | None) -> list[tuple[str, bytes]]:
    """The headers to send with this record (empty when not traced); records its span."""
    tracing = _SWITCH.tracing if _SWITCH.decided else _SWITCH.get()
    return _NO_HEADERS if tracing is None else tracing.send(topic, value)


def trace_receive(topic: str, value: bytes | None, headers: Headers | None) -> None:
    """Record the receipt of this record, continuing the trace of its headers."""
    tracing = _SWITCH.tracing if _SWITCH.decided else _SWITCH.get()
    if tracing is not None:
        tracing.receive(topic, value, headers)
