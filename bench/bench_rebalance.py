"""Scale-out figures: probe latency and cancelled triggers while members join and leave.

Two ``deferline triggerer`` processes hold ``--timers`` waiting timers (due in an hour);
due-now DeferRequests go out at ``--probe-rate`` per second as probes. After a steady
window a third member joins; after another window one of the first two leaves (SIGTERM).
For each window (the ``--window`` seconds after each change) the script prints the probe
latency (produce to event read back) p50 / p99 / max and, per member that stayed, how many
of its triggers were cancelled. Figures are printed, never asserted.

Several builds can be measured back to back on one broker (``--variant NAME=PATH`` with the
path of a ``deferline`` executable), e.g. the base checkout against this one::

    .venv/bin/python bench/bench_rebalance.py --backend kafka \\
        --variant before=<checkout of f32118c>/.venv/bin/deferline \\
        --variant after=.venv/bin/deferline
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiokafka import AIOKafkaProducer
from deferline.schemas import (
    DeferRequest,
    TaskKey,
    TriggerEventRecord,
    decode,
    encode,
    make_trigger_id,
    utcnow,
)
from deferline.topics import (
    Settings,
    TopicNames,
    ensure_topics,
    make_consumer,
    make_producer,
    partition_for,
    topic_specs,
)
from deferline.topics.testing import free_port

from bench._figures import Figure, Sitting, is_this_build, size_slug
from bench._harness import local_broker, rss_mb

DATETIME = "deferline.engine.triggers.DateTimeTrigger"
PARTITIONS = 12
_STARTED: list[Member] = []


def request(i: int, moment: dt.datetime, run: str) -> DeferRequest:
    task = TaskKey(dag_id="bench", task_id="wait", run_id=f"{run}-{i}")
    return DeferRequest(
        trigger_id=make_trigger_id(task, 0),
        task=task,
        classpath=DATETIME,
        kwargs={"moment": moment},
    )


async def produce(producer: AIOKafkaProducer, topic: str, requests: Sequence[DeferRequest]) -> None:
    for start in range(0, len(requests), 5000):
        futures = [
            await producer.send(topic, key=r.trigger_id.encode(), value=encode(r))
            for r in requests[start : start + 5000]
        ]
        await asyncio.gather(*futures)


class Member:
    """A ``deferline triggerer`` subprocess and its metrics endpoint."""

    def __init__(self, exe: str, settings: Settings, name: str, workdir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                exe,
                "triggerer",
                "--bootstrap-servers",
                settings.bootstrap_servers,
                "--topic-prefix",
                settings.topic_prefix,
                "--member",
                name,
                "--state-dir",
                str(workdir / f"{settings.topic_prefix}{name}-state"),
                "--metrics-port",
                str(self.port),
                "--metrics-host",
                "127.0.0.1",
                "--log-format",
                "json",
                "--log-level",
                "WARNING",
                "--no-create-topics",
                "--session-timeout-ms",
                "10000",
                "--capacity",
                "2000000",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(workdir / f"{settings.topic_prefix}{name}.log").open("wb"),
        )
        _STARTED.append(self)

    async def metrics(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """Metric values summed over their labels (``{}`` when not answering)."""
        try:
            async with session.get(f"http://127.0.0.1:{self.port}/metrics") as response:
                text = await response.text()
        except aiohttp.ClientError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^([^#\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
            if match:
                out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(3))
        return out

    async def partitions(self, session: aiohttp.ClientSession) -> set[int]:
        """The partitions this member owns now (from its per-partition gauge)."""
        try:
            async with session.get(f"http://127.0.0.1:{self.port}/metrics") as response:
                text = await response.text()
        except aiohttp.ClientError:
            return set()
        found = re.findall(
            r'^deferline_triggerer_active_triggers\{[^}]*partition="(\d+)"', text, re.M
        )
        return {int(n) for n in found}

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def total(session: aiohttp.ClientSession, members: Sequence[Member], name: str) -> float:
    values = [await m.metrics(session) for m in members]
    return sum(v.get(name, 0.0) for v in values)


async def settle(
    session: aiohttp.ClientSession, members: Sequence[Member], timers: int, within: float
) -> float:
    """Wait until the members own every partition and run every waiting timer."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        owned = await total(session, members, "deferline_triggerer_assigned_partitions")
        waiting = await total(session, members, "deferline_triggers_waiting_timers")
        if owned == PARTITIONS and waiting >= timers:
            return time.monotonic() - started
        await asyncio.sleep(0.2)
    raise TimeoutError(f"members did not settle within {within:.0f} s")


def percentiles(values: list[float]) -> str:
    if not values:
        return "no probes"
    values = sorted(values)
    p50 = values[len(values) // 2]
    p99 = values[max(0, int(len(values) * 0.99) - 1)]
    return f"{p50 * 1000:,.0f} / {p99 * 1000:,.0f} / {values[-1] * 1000:,.0f} ms"


async def scenario(
    exe: str, bootstrap: str, timers: int, rate: float, window: float, workdir: Path
) -> dict[str, Any]:
    settings = Settings(
        bootstrap_servers=bootstrap,
        topic_prefix=f"r{uuid.uuid4().hex[:8]}.",
        partitions=PARTITIONS,
    )
    await ensure_topics(settings, topic_specs(settings))
    names = TopicNames(settings.topic_prefix)
    producer = make_producer(settings, linger_ms=5)
    await producer.start()
    later = utcnow() + dt.timedelta(hours=2)
    t0 = time.monotonic()
    await produce(producer, names.defer(), [request(i, later, "wait") for i in range(timers)])
    print(f"  {timers:,} waiting timers produced in {time.monotonic() - t0:.1f} s")
    probe_producer = make_producer(settings, linger_ms=0)
    await probe_producer.start()
    consumer = make_consumer(settings, names.resume(), group_id=None, fetch_max_wait_ms=5)
    await consumer.start()
    sent: dict[str, float] = {}
    latency: dict[str, float] = {}
    result: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        a = Member(exe, settings, "a", workdir)
        b = Member(exe, settings, "b", workdir)
        try:
            seconds = await settle(session, [a, b], timers, 900)
            print(f"  two members settled in {seconds:.1f} s; RSS a {rss_mb(a.proc.pid):.0f} MB")
            stop_probes = asyncio.Event()

            async def probe() -> None:
                i = 0
                while not stop_probes.is_set():
                    r = request(i, utcnow(), "probe")
                    sent[r.trigger_id] = time.monotonic()
                    await probe_producer.send(
                        names.defer(), key=r.trigger_id.encode(), value=encode(r)
                    )
                    i += 1
                    await asyncio.sleep(1 / rate)

            async def read() -> None:
                while True:
                    batches = await consumer.getmany(timeout_ms=100)
                    now = time.monotonic()
                    for records in batches.values():
                        for record in records:
                            if record.value is None:
                                continue
                            event = decode(record.value)
                            if isinstance(event, TriggerEventRecord):
                                started = sent.get(event.trigger_id)
                                if started is not None:
                                    latency.setdefault(event.trigger_id, now - started)

            reader = asyncio.create_task(read())
            prober = asyncio.create_task(probe())
            cancelled = "deferline_triggers_cancelled_total"
            marks: list[tuple[str, float]] = []
            per_member: dict[str, dict[str, float]] = {}

            moved: dict[str, set[int]] = {"steady": set()}

            async def owners(members: Sequence[Member]) -> dict[int, str]:
                return {n: m.name for m in members for n in await m.partitions(session)}

            marks.append(("steady", time.monotonic()))
            await asyncio.sleep(window)
            base = {m.name: (await m.metrics(session)).get(cancelled, 0.0) for m in (a, b)}
            before = await owners([a, b])
            marks.append(("join", time.monotonic()))
            c = Member(exe, settings, "c", workdir)
            await asyncio.sleep(window)
            joined = {m.name: (await m.metrics(session)).get(cancelled, 0.0) for m in (a, b, c)}
            per_member["join"] = {n: joined[n] - base.get(n, 0.0) for n in ("a", "b")}
            after = await owners([a, b, c])
            moved["join"] = {n for n in range(PARTITIONS) if before.get(n) != after.get(n)}
            marks.append(("leave", time.monotonic()))
            await asyncio.to_thread(b.stop)
            await asyncio.sleep(window)
            left = {m.name: (await m.metrics(session)).get(cancelled, 0.0) for m in (a, c)}
            per_member["leave"] = {n: left[n] - joined[n] for n in ("a", "c")}
            final = await owners([a, c])
            moved["leave"] = {n for n in range(PARTITIONS) if after.get(n) != final.get(n)}
            end = time.monotonic()
            stop_probes.set()
            await prober
            deadline = time.monotonic() + 60
            while len(latency) < len(sent) and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            for m in (a, c):
                values = await m.metrics(session)
                for key in (
                    "deferline_triggerer_rebalance_partitions_total",
                    "deferline_triggerer_partition_pause_seconds_sum",
                    "deferline_triggerer_partition_pause_seconds_count",
                ):
                    if key in values:
                        result[f"{m.name}:{key}"] = values[key]
            partition_of = {t: partition_for(t.encode(), PARTITIONS) for t in sent}
            bounds = [*marks, ("end", end)]
            for (label, start), (_, stop) in itertools.pairwise(bounds):
                stop = min(stop, start + window)
                ids = [t for t, s in sent.items() if start <= s < stop]
                got = [latency[t] for t in ids if t in latency]
                missing = len(ids) - len(got)
                line = f"  {label:7s} probes {len(ids):4d}: p50 / p99 / max {percentiles(got)}"
                if missing:
                    line += f" ({missing} not fired within 60 s)"
                if label in per_member:
                    counts = ", ".join(f"{n} {v:,.0f}" for n, v in per_member[label].items())
                    line += f"; triggers cancelled on the members that stayed: {counts}"
                print(line)
                if moved.get(label):
                    shift = moved[label]
                    kept_ids = [t for t in ids if partition_of[t] not in shift and t in latency]
                    moved_ids = [t for t in ids if partition_of[t] in shift and t in latency]
                    print(
                        f"          kept partitions: {percentiles([latency[t] for t in kept_ids])}"
                        f"; moved partitions {sorted(shift)}: "
                        f"{percentiles([latency[t] for t in moved_ids])}"
                    )
                    result[f"{label}:kept"] = [latency[t] for t in kept_ids]
                    result[f"{label}:moved"] = [latency[t] for t in moved_ids]
                result[label] = got
            for key, value in sorted(result.items()):
                if ":" in key and not isinstance(value, list):
                    print(f"  {key} = {value:,.3f}")
            result["cancelled"] = per_member
        finally:
            for member in list(_STARTED):
                member.stop(signal.SIGKILL)
            _STARTED.clear()
            await consumer.stop()
            await producer.stop()
            await probe_producer.stop()
    return result


def _p99_ms(values: Sequence[float]) -> str:
    ordered = sorted(values)
    return f"{ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1000:,.0f}" if ordered else "-"


def _figures(timers: int, results: Sequence[tuple[str, bool, dict[str, Any]]]) -> list[Figure]:
    """The run's claims: this build's p99 after the join and the leave, the others in notes."""
    ours = [result for _, this, result in results if this]
    if not ours:
        return []
    mine, others = ours[0], {name: r for name, this, r in results if not this}

    def kept_moved(result: dict[str, Any], change: str) -> str:
        return f"{_p99_ms(result[f'{change}:kept'])} / {_p99_ms(result[f'{change}:moved'])}"

    figures = []
    for change, what in (
        ("join", "a third triggerer joins two holding {:,} waiting timers"),
        ("leave", "one of three triggerers holding {:,} waiting timers leaves"),
    ):
        if f"{change}:kept" not in mine:
            continue
        beside = "; ".join(
            f"{name}, same run: {kept_moved(r, change)} ms"
            for name, r in others.items()
            if f"{change}:kept" in r
        )
        figures.append(
            Figure(
                f"rebalance.{change}_probe_p99_{size_slug(timers)}",
                f"{what.format(timers)}: probe p99, kept / moved partitions",
                kept_moved(mine, change),
                "ms",
                note=beside,
            )
        )
    cancelled = mine["cancelled"]
    figures.append(
        Figure(
            f"rebalance.cancelled_on_stayers_{size_slug(timers)}",
            f"triggers cancelled on the members that stayed ({timers:,} waiting timers)",
            "; ".join(
                f"{change}: " + " + ".join(f"{count:,.0f}" for count in counts.values())
                for change, counts in cancelled.items()
            ),
            "",
        )
    )
    return figures


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=["tansu", "kafka"], default="tansu")
    parser.add_argument("--bootstrap", default=None, help="use this running cluster instead")
    parser.add_argument("--timers", type=int, default=100_000)
    parser.add_argument("--probe-rate", type=float, default=50.0)
    parser.add_argument("--window", type=float, default=15.0)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a deferline executable to measure (repeatable) [this environment's]",
    )
    args = parser.parse_args()
    sitting = Sitting.begin("rebalance", broker=args.backend)
    variants = [tuple(v.split("=", 1)) for v in args.variant] or [
        ("this", str(Path(sys.executable).with_name("deferline")))
    ]
    print(
        f"backend {args.backend}; {args.timers:,} waiting timers on 2 members, probes at "
        f"{args.probe_rate:.0f}/s, {args.window:.0f} s windows; {os.cpu_count()} cores"
    )
    results: list[tuple[str, bool, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        async with local_broker(args.backend, args.bootstrap) as bootstrap:
            for name, exe in variants:
                print(f"\n== {name}: {exe} ==")
                result = await scenario(
                    exe, bootstrap, args.timers, args.probe_rate, args.window, Path(tmp)
                )
                results.append((name, is_this_build(exe), result))
    sitting.write(_figures(args.timers, results))


if __name__ == "__main__":
    try:
        asyncio.run(main())
    finally:
        for member in _STARTED:
            member.stop(signal.SIGKILL)
