"""Micro-benchmark of the wire codec: µs per DeferRequest encoded and decoded, plain and sealed;
and the partitioner's hash of a task key.

Run: .venv/bin/python -m bench.bench_schemas [--number N]
Prints a Markdown table (best of 5 repeats) and records it (bench/_figures.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import timeit
from collections.abc import Callable

import pydantic
from deferline.schemas import (
    DeferRequest,
    KwargsCipher,
    ResumeTarget,
    TaskKey,
    decode,
    decode_as,
    decode_deferral,
    encode,
    make_event_id,
    make_trigger_id,
    open_kwargs,
    seal,
)
from deferline.topics import partition_for
from deferline.topics.testing import murmur2_reference

from bench._figures import Figure, Peer, Sitting

# The printed rows recorded, by name: claim id; the Python murmur2 is partition_for's peer.
CLAIMS = {
    "encode DeferRequest (plain)": "schemas.encode_defer_request",
    "decode DeferRequest (plain)": "schemas.decode_defer_request",
    "decode_as DeferRequest (plain)": "schemas.decode_as_defer_request",
    "decode_deferral (plain: the triggerer's read)": "schemas.decode_deferral",
    "seal + encode DeferRequest": "schemas.seal_encode",
    "decode + open_kwargs (sealed)": "schemas.decode_open_kwargs",
    "make_trigger_id": "schemas.make_trigger_id",
    "make_event_id": "schemas.make_event_id",
    "partition_for(ti_key, 12)": "schemas.partition_for",
}
REFERENCE = "murmur2 of ti_key, the Python reference"


def sample_request() -> DeferRequest:
    """A typical deferral: a DateTimeTrigger with a resume target, as a worker sends it."""
    task = TaskKey(dag_id="etl_daily", task_id="wait_for_window", run_id="scheduled__2030-01-02")
    moment = dt.datetime(2030, 1, 2, 6, 0, tzinfo=dt.UTC)
    return DeferRequest(
        trigger_id=make_trigger_id(task, 0),
        task=task,
        classpath="deferline.engine.triggers.DateTimeTrigger",
        kwargs={"moment": moment, "end_from_trigger": False},
        next_kwargs={"attempt": 1},
        timeout_at=moment + dt.timedelta(hours=1),
        requested_at=moment - dt.timedelta(hours=6),
        resume=ResumeTarget(operator="pkg.ops.WaitOperator", op_kwargs={"window": "06:00"}),
    )


def best_us(fn: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--number", type=int, default=20_000, help="calls per repeat")
    args = parser.parse_args()
    n: int = args.number
    sitting = Sitting.begin("schemas")

    request = sample_request()
    cipher = KwargsCipher([KwargsCipher.generate_key()])
    plain = encode(request)
    sealed_request = seal(request, cipher)
    sealed = encode(sealed_request)
    payload = {"moment": request.kwargs["moment"]}
    ti_key = request.task.ti_key.encode()

    rows = [
        ("encode DeferRequest (plain)", len(plain), lambda: encode(request)),
        ("decode DeferRequest (plain)", len(plain), lambda: decode(plain)),
        ("decode_as DeferRequest (plain)", len(plain), lambda: decode_as(plain, DeferRequest)),
        (
            "decode_deferral (plain: the triggerer's read)",
            len(plain),
            lambda: decode_deferral(plain),
        ),
        ("seal + encode DeferRequest", len(sealed), lambda: encode(seal(request, cipher))),
        (
            "decode + open_kwargs (sealed)",
            len(sealed),
            lambda: open_kwargs(decode_as(sealed, DeferRequest), cipher),
        ),
        ("make_trigger_id", None, lambda: make_trigger_id(request.task, 0)),
        ("make_event_id", None, lambda: make_event_id(request.trigger_id, "fired", payload)),
        ("partition_for(ti_key, 12)", len(ti_key), lambda: partition_for(ti_key, 12)),
        (
            "murmur2 of ti_key, the Python reference",
            len(ti_key),
            lambda: murmur2_reference(ti_key),
        ),
    ]
    print(
        f"Python {platform.python_version()}, pydantic {pydantic.VERSION}, "
        f"{platform.machine()}, best of 5 x {n} calls"
    )
    print()
    print("| operation | bytes | µs/op | ops/s |")
    print("|---|---:|---:|---:|")
    measured: dict[str, tuple[int | None, float]] = {}
    for name, size, fn in rows:
        us = best_us(fn, n)
        measured[name] = size, us
        shown = "" if size is None else str(size)
        print(f"| {name} | {shown} | {us:.2f} | {1e6 / us:,.0f} |")
    reference = Peer("the Python reference, same run", round(measured[REFERENCE][1], 2))
    figures = []
    for name, claim in CLAIMS.items():
        size, us = measured[name]
        figures.append(
            Figure(
                claim,
                name if size is None else f"{name}, {size} B",
                round(us, 2),
                "µs",
                peer=reference if claim == "schemas.partition_for" else None,
                note=f"{1e6 / us:,.0f}/s on one core",
            )
        )
    sitting.write(figures)


if __name__ == "__main__":
    main()
