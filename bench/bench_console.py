"""`deferline console` against a cluster holding many tasks: page load, catch-up, live lag, memory.

Produces ``--tasks`` task states (the tasks topic: 97 % success, 2 % failed, 1 % deferred
now) and one trigger event per fifth task, then starts ``deferline console`` as a subprocess
(its memory is its own) and measures:

- the first page load: the page and its scripts, styles and first snapshot, from the moment
  the server answers (the figures then fill in while the history is read);
- the catch-up: start → every record read (status ``live``: the counts are exact);
- live updates: a task state produced now → the pushed snapshot counting it (SSE), N times;
- its peak RSS, and the bytes it fetched per second while catching up and while idle.

Run: .venv/bin/python -m bench.bench_console                       (embedded Tansu broker)
     .venv/bin/python -m bench.bench_console --tasks 100000 --backend kafka
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from deferline.schemas import TaskKey, TaskStateRecord, TriggerEventRecord, encode, make_event_id
from deferline.topics import Settings, TopicNames, ensure_topics, make_producer, topic_specs

from bench._figures import Figure, Sitting
from bench._harness import local_broker, machine_line, peak_rss_mb, produce_batched, quantile

DEFERLINE = str(Path(sys.executable).with_name("deferline"))
PARTITIONS = 12


async def produce(settings: Settings, tasks: int) -> float:
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    now = dt.datetime.now(dt.UTC)
    states: list[tuple[bytes, bytes]] = []
    events: list[tuple[bytes, bytes]] = []
    for i in range(tasks):
        task = TaskKey(dag_id="bench", task_id=f"t{i}", run_id="run1")
        name = "deferred" if i % 100 == 0 else ("failed" if i % 50 == 1 else "success")
        record = TaskStateRecord(task=task, state=name, updated_at=now, trigger_id=f"tr{i}")
        states.append((task.ti_key.encode(), encode(record)))
        if i % 5 == 0:
            event = TriggerEventRecord(
                event_id=make_event_id(f"tr{i}", "fired", None),
                trigger_id=f"tr{i}",
                task=task,
                status="fired",
                emitted_at=now,
            )
            events.append((f"tr{i}".encode(), encode(event)))
    producer = make_producer(settings, acks=1, linger_ms=20, max_batch_size=512 * 1024)
    await producer.start()
    started = time.perf_counter()
    try:
        await produce_batched(producer, names.tasks, states, PARTITIONS)
        await produce_batched(producer, names.resume(), events, PARTITIONS)
    finally:
        await producer.stop()
    return time.perf_counter() - started


async def snapshot(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with http.get(f"{base}/api/snapshot") as response:
        data: dict[str, Any] = await response.json()
        return data


async def first_page(http: aiohttp.ClientSession, base: str) -> float:
    """Seconds to fetch what a browser fetches for the first view."""
    started = time.perf_counter()
    for path in ("/", "/static/console.js", "/static/console.css", "/report.css"):
        async with http.get(base + path) as response:
            await response.read()
    await snapshot(http, base)
    return time.perf_counter() - started


async def live_lags(settings: Settings, base: str, samples: int) -> list[float]:
    """A new deferred task produced now → the first pushed snapshot that counts it."""
    names = TopicNames(settings.topic_prefix)
    producer = make_producer(settings)
    await producer.start()
    lags: list[float] = []
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{base}/api/stream", timeout=aiohttp.ClientTimeout(total=None)) as stream,
        ):
            seen = -1
            for i in range(samples):
                task = TaskKey(dag_id="bench", task_id=f"live{i}", run_id="run1")
                record = TaskStateRecord(task=task, state="deferred", trigger_id=f"live{i}")
                before = seen
                sent = time.perf_counter()
                await producer.send_and_wait(names.tasks, encode(record), key=task.ti_key.encode())
                while True:
                    line = await stream.content.readline()
                    if not line.startswith(b"data: "):
                        continue
                    data = json.loads(line[6:])
                    seen = data["overview"]["tasks"].get("deferred", 0)
                    if before >= 0 and seen > before:
                        lags.append(time.perf_counter() - sent)
                        break
                    if before < 0:
                        before = seen - 1 if seen else 0  # the first frame: take its count
                await asyncio.sleep(0.3)
    finally:
        await producer.stop()
    return lags


async def run(args: argparse.Namespace) -> None:
    sitting = Sitting.begin("console", broker=args.backend)
    async with local_broker(args.backend, args.bootstrap) as bootstrap:
        prefix = f"bc{uuid.uuid4().hex[:8]}."
        settings = Settings(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions=PARTITIONS)
        produced_s = await produce(settings, args.tasks)
        port = 18000 + os.getpid() % 1000
        base = f"http://127.0.0.1:{port}"
        argv = [DEFERLINE, "console", "--port", str(port), "--bootstrap-servers", bootstrap]
        argv += ["--topic-prefix", prefix, "--log-level", "WARNING"]
        started = time.perf_counter()
        console = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL)
        try:
            async with aiohttp.ClientSession() as http:
                while True:
                    try:
                        await snapshot(http, base)
                        break
                    except aiohttp.ClientConnectionError:
                        if console.returncode is not None:
                            code = console.returncode
                            raise SystemExit(f"deferline console exited: {code}") from None
                        await asyncio.sleep(0.05)
                serving_s = time.perf_counter() - started
                page_s = await first_page(http, base)
                marks: list[tuple[float, int]] = []
                while True:
                    data = await snapshot(http, base)
                    marks.append((time.perf_counter(), data["console"]["fetched_bytes"]))
                    if data["status"]["state"] == "live":
                        break
                    await asyncio.sleep(0.5)
                live_s = time.perf_counter() - started
                counted = sum(data["overview"]["tasks"].values()) if data["overview"] else 0
                catch_bytes = marks[-1][1]
                idle_from = marks[-1]
                await asyncio.sleep(args.idle)
                idle = await snapshot(http, base)
                idle_rate = (idle["console"]["fetched_bytes"] - idle_from[1]) / args.idle
            lags = sorted(await live_lags(settings, base, args.samples))
            rss = peak_rss_mb(console.pid)
        finally:
            console.terminate()
            await console.wait()
    print(machine_line())
    print(f"broker: {args.backend if not args.bootstrap else args.bootstrap}")
    rows = [
        ("tasks on the tasks topic", f"{args.tasks:,} (+{args.tasks // 5:,} events)"),
        ("produced in", f"{produced_s:.1f} s"),
        ("console serving after", f"{serving_s:.2f} s"),
        ("first page load (page, scripts, styles, snapshot)", f"{page_s * 1000:.0f} ms"),
        ("catch-up: start → every record read (status live)", f"{live_s:.1f} s"),
        ("tasks counted when live", f"{counted:,}"),
        ("fetched while catching up", f"{catch_bytes / 2**20:.0f} MiB"),
        (f"fetched while idle ({args.idle:.0f} s)", f"{idle_rate:.0f} B/s"),
        (
            f"live update lag p50 / max ({len(lags)} samples)",
            f"{quantile(lags, 0.5) * 1000:.0f} / {lags[-1] * 1000:.0f} ms",
        ),
        ("console peak RSS", f"{rss:.0f} MiB"),
    ]
    for label, value in rows:
        print(f"| {label} | {value} |")
    over = f"`deferline console` over {args.tasks:,} task states and {args.tasks // 5:,} events"
    sitting.write(
        [
            Figure(
                "console.serving_after_start",
                f"{over}: serving after start",
                round(serving_s, 2),
                "s",
                note=f"first page load {page_s * 1000:.0f} ms",
            ),
            Figure(
                "console.catch_up",
                "catch-up until every count is exact",
                round(live_s, 1),
                "s",
                note=f"{catch_bytes / 2**20:.0f} MiB fetched",
            ),
            Figure(
                "console.live_update",
                "live update behind the topics, p50 / max",
                f"{quantile(lags, 0.5) * 1000:.0f} / {lags[-1] * 1000:.0f}",
                "ms",
            ),
            Figure("console.idle_fetch", "fetched while idle", round(idle_rate), "B/s"),
            Figure("console.peak_rss", "console peak RSS", round(rss), "MiB"),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--backend", choices=["tansu", "kafka"], default="tansu")
    parser.add_argument("--bootstrap", help="use this running broker instead of starting one")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--idle", type=float, default=20.0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
