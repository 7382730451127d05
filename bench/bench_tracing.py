"""The cost of the trace hooks per record: off (no OTEL_* variables) and on (an SDK provider).

Each record produced or read by the loop passes one hook; off, it is one test and a return.
Run: .venv/bin/python -m bench.bench_tracing [--n 200000]
"""

from __future__ import annotations

import argparse
import time

from deferline.schemas import DeferRequest, TaskKey, encode
from deferline.topics import disable_tracing, enable_tracing, trace_receive, trace_send

from bench._figures import Figure, Sitting
from bench._harness import machine_line


def per_call_ns(n: int, value: bytes, headers: list[tuple[str, bytes]]) -> tuple[float, float]:
    started = time.perf_counter()
    for _ in range(n):
        trace_send("p.defer", value)
    send = (time.perf_counter() - started) / n * 1e9
    started = time.perf_counter()
    for _ in range(n):
        trace_receive("p.defer", value, headers)
    receive = (time.perf_counter() - started) / n * 1e9
    return send, receive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args()
    sitting = Sitting.begin("tracing")
    request = DeferRequest(
        trigger_id="t-1",
        task=TaskKey(dag_id="d", task_id="t", run_id="r"),
        classpath="deferline.engine.triggers.DateTimeTrigger",
        kwargs={"moment": "2030-01-01T00:00:00+00:00"},
    )
    value = encode(request)
    parent = [("traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")]
    disable_tracing()
    off = per_call_ns(args.n, value, parent)
    from opentelemetry.sdk.trace import TracerProvider  # only for the "on" figures

    enable_tracing(TracerProvider())  # spans made and ended, exported nowhere
    on = per_call_ns(args.n // 10, value, parent)
    disable_tracing()
    print(machine_line())
    print("| hook | off (ns/record) | on, SDK provider without exporter (ns/record) |")
    print("|---|---|---|")
    print(f"| trace_send | {off[0]:.0f} | {on[0]:.0f} |")
    print(f"| trace_receive | {off[1]:.0f} | {on[1]:.0f} |")
    sitting.write(
        Figure(f"tracing.{hook}_{state}", f"`{hook}` per record, tracing {label}", round(ns), "ns")
        for state, label, figures in (
            ("off", "off (no OTEL_* variables)", off),
            ("on", "on (an SDK provider without exporter)", on),
        )
        for hook, ns in zip(("trace_send", "trace_receive"), figures, strict=True)
    )


if __name__ == "__main__":
    main()
