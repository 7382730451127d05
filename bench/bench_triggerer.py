"""Triggerer figures: ingest and fire rates, bootstrap, end-to-end latency, failover.

Each triggerer runs as a real ``deferline triggerer`` process; this script produces the
requests, reads the events back and scrapes the members' metrics. Figures are printed,
never asserted. Usage::

    .venv/bin/python -m bench.bench_triggerer [--backend tansu|kafka] [--n 100000]
        [--only throughput,latency,failover,burst,idle] [--burst-sizes 10000,100000,1000000]
        [--member-flags "--fetch-max-wait-ms 5"] [--deferline <another checkout's deferline>]

``burst`` is the memory curve: N timers wait in one member (RSS sampled), then all fall
due at once; the RSS is sampled every 20 ms while they fire, and events/s and CPU per
fired trigger come from the events read back. ``idle`` is the CPU of a member that owns
12 empty partitions, over 20 s. Both only use flags every version of the triggerer has,
so the script can measure an older checkout too: ``--deferline`` runs that checkout's
``deferline`` (its ``.venv/bin/deferline``) as the members.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiokafka import AIOKafkaProducer
from deferline.schemas import (
    DeferRequest,
    ResumeTarget,
    TaskKey,
    TriggerEventRecord,
    decode,
    encode,
    make_trigger_id,
    utcnow,
)
from deferline.topics import (
    KRaftBroker,
    Settings,
    TansuBroker,
    TopicNames,
    ensure_topics,
    make_consumer,
    make_producer,
    topic_specs,
)
from deferline.topics.testing import free_port

from bench._figures import Figure, Sitting, size_slug
from bench._harness import produce_batched, record_batches, send_batches

DEFERLINE = str(Path(sys.executable).with_name("deferline"))
DATETIME = "deferline.engine.triggers.DateTimeTrigger"
# ANCHORS.md: Airflow 2.10.5, one triggerer, PostgreSQL 15, this machine.
AIRFLOW: dict[str, Any] = {
    "fires_per_s_10k": 742.0,
    "due_to_all_fired_10k_s": 13.5,
    "due_to_all_fired_1k_s": 1.9,
    "cpu_ms_per_fire": 4.5,
    "rss_kb_per_waiting_trigger": 24.0,
    "failover_s": 10.5,
    "overhead_s": (0.3, 1.4),
}


# What a worker writes with every deferral: how to resume the task (ResumeTarget).
RESUME = ResumeTarget(operator="deferline.engine.examples.WaitOperator", op_kwargs={"seconds": 5})


def request(i: int, moment: dt.datetime, run: str) -> DeferRequest:
    task = TaskKey(dag_id="bench", task_id="wait", run_id=f"{run}-{i}")
    return DeferRequest(
        trigger_id=make_trigger_id(task, 0),
        task=task,
        classpath=DATETIME,
        kwargs={"moment": moment},
        resume=RESUME,
    )


async def produce(producer: AIOKafkaProducer, topic: str, requests: Sequence[DeferRequest]) -> None:
    for start in range(0, len(requests), 5000):
        chunk = requests[start : start + 5000]
        futures = [
            await producer.send(topic, key=r.trigger_id.encode(), value=encode(r)) for r in chunk
        ]
        await asyncio.gather(*futures)


_STARTED: list[Member] = []


class Member:
    """A ``deferline triggerer`` subprocess with its metrics endpoint and resource use."""

    executable = DEFERLINE  # ``--deferline``: another checkout's, for before/after figures

    def __init__(self, settings: Settings, name: str, workdir: Path, *flags: str) -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                self.executable,
                "triggerer",
                "--bootstrap-servers",
                settings.bootstrap_servers,
                "--topic-prefix",
                settings.topic_prefix,
                "--member",
                name,
                "--state-dir",
                str(workdir / f"{name}-state"),
                "--metrics-port",
                str(self.port),
                "--metrics-host",
                "127.0.0.1",
                "--log-format",
                "json",
                "--log-level",
                "WARNING",
                "--no-create-topics",
                *flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("wb"),
        )
        _STARTED.append(self)

    async def metrics(self, session: aiohttp.ClientSession, *names: str) -> dict[str, float]:
        """Metric values summed over their labels; only ``names`` if given (a full scrape
        costs the member about 1 ms of CPU: polled every 10 ms, 8 % of a core)."""
        try:
            url = f"http://127.0.0.1:{self.port}/metrics"
            query = [("name[]", name) for name in names]
            async with session.get(url, params=query) as response:
                text = await response.text()
        except aiohttp.ClientError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^([^#\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
            if match:  # summed over labels
                out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(3))
        return out

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def wait_for(
    session: aiohttp.ClientSession,
    member: Member,
    name: str,
    target: float,
    within: float = 300.0,
    interval: float = 0.02,
) -> float:
    """Poll ``member``'s metric ``name`` until it reaches ``target``; monotonic time then."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if (await member.metrics(session, name)).get(name, -1) >= target:
            return time.monotonic()
        await asyncio.sleep(interval)
    raise TimeoutError(f"{member.name}: {name} did not reach {target}")


@contextlib.asynccontextmanager
async def cluster(backend: str) -> AsyncIterator[str]:
    broker: TansuBroker | KRaftBroker = TansuBroker() if backend == "tansu" else KRaftBroker()
    await broker.start()
    try:
        yield broker.bootstrap
    finally:
        await broker.stop()


def fresh_settings(bootstrap: str, partitions: int) -> Settings:
    return Settings(
        bootstrap_servers=bootstrap,
        topic_prefix=f"b{uuid.uuid4().hex[:8]}.",
        partitions=partitions,
    )


async def read_events(settings: Settings, count: int, within: float) -> list[Any]:
    """Read ``count`` events from the resume topic; (record timestamp ms, event) pairs."""
    consumer = make_consumer(settings, TopicNames(settings.topic_prefix).resume(), group_id=None)
    await consumer.start()
    out: list[Any] = []
    deadline = time.monotonic() + within
    try:
        while len(out) < count and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200, max_records=50_000)
            for records in batches.values():
                out.extend((r.timestamp, r.value) for r in records)
    finally:
        await consumer.stop()
    return out


# -- throughput: bootstrap, live ingest, fire rate ---------------------------------------------


async def bench_throughput(bootstrap: str, n: int, workdir: Path) -> dict[str, float]:
    print(f"\n== throughput: one triggerer process, {n:,} DateTimeTriggers ==")
    results: dict[str, float] = {}
    settings = fresh_settings(bootstrap, 12)
    await ensure_topics(settings, topic_specs(settings))
    names = TopicNames(settings.topic_prefix)
    producer = make_producer(settings, linger_ms=5, max_batch_size=512 * 1024)
    await producer.start()
    far = utcnow() + dt.timedelta(hours=1)
    try:
        # 1. Bootstrap: n active triggers already on the topic when the member starts.
        await produce(producer, names.defer(), [request(i, far, "boot") for i in range(n)])
        async with aiohttp.ClientSession() as session:
            member = Member(settings, "boot", workdir, "--capacity", str(2 * n))
            started = time.monotonic()
            running_at = await wait_for(session, member, "deferline_triggers_running", n)
            metrics = await member.metrics(session)
            boot = metrics.get("deferline_triggerer_bootstrap_seconds_sum", 0.0)
            results["bootstrap_s"] = boot
            results["start_to_running_s"] = running_at - started
            results["rss_mb_waiting"] = member.rss_mb()
            print(
                f"bootstrap of {n:,} active triggers: {boot:.2f} s (metric); process start to "
                f"all running {running_at - started:.2f} s; RSS {member.rss_mb():.0f} MB "
                f"({member.rss_mb() * 1024 / n:.2f} KB per waiting trigger incl. runtime)"
            )
            member.stop()

            # 1b. The same member restarted: its checkpoints leave only the tail to read.
            member = Member(settings, "boot", workdir, "--capacity", str(2 * n))
            started = time.monotonic()
            running_at = await wait_for(session, member, "deferline_triggers_running", n)
            metrics = await member.metrics(session)
            boot = metrics.get("deferline_triggerer_bootstrap_seconds_sum", 0.0)
            read = metrics.get("deferline_triggerer_bootstrap_records_total", 0.0)
            results["bootstrap_checkpoint_s"] = boot
            print(
                f"restart from checkpoints: bootstrap {boot:.2f} s, {read:.0f} records read; "
                f"process start to all running {running_at - started:.2f} s"
            )
            member.stop()

            # 2. Live ingest then fire: a settled member, n triggers due at one moment.
            settings2 = fresh_settings(bootstrap, 12)
            await ensure_topics(settings2, topic_specs(settings2))
            names2 = TopicNames(settings2.topic_prefix)
            member = Member(settings2, "live", workdir, "--capacity", str(2 * n))
            await wait_for(session, member, "deferline_triggerer_assigned_partitions", 12)
            await asyncio.sleep(1.0)
            lead = max(10.0, n / 8000)
            due = utcnow() + dt.timedelta(seconds=lead)
            requests = [request(i, due, "live") for i in range(n)]
            payloads = [(r.trigger_id.encode(), encode(r)) for r in requests]
            # Batches built ahead, sent at once: the bench's own producer must not be what
            # sets the pace (per-record sends topped out near 35,000/s here), nor take the
            # member's CPU partitioning keys while the clock runs.
            batches = record_batches(producer, payloads, 12)
            cpu0 = member.cpu_seconds()
            sent = time.monotonic()
            await send_batches(producer, names2.defer(), batches)
            produced = time.monotonic()
            running_at = await wait_for(
                session, member, "deferline_triggerer_deferrals_total", n, interval=0.01
            )
            ingest_cpu = member.cpu_seconds() - cpu0
            rate = n / (running_at - sent)
            results["ingest_per_s"] = rate
            results["ingest_cpu_us"] = ingest_cpu / n * 1e6
            print(
                f"live ingest: {n:,} produced in {produced - sent:.2f} s, all ingested after "
                f"{running_at - sent:.2f} s -> {rate:,.0f} deferrals/s "
                f"(triggerer CPU {ingest_cpu:.2f} s, {ingest_cpu / n * 1e6:.0f} µs each)"
            )
            remaining = (due - utcnow()).total_seconds()
            if remaining < 0:
                print(f"  (ingest overran the due time by {-remaining:.1f} s)")
            cpu1 = member.cpu_seconds()
            events = await read_events(settings2, n, within=lead + 300)
            fire_cpu = member.cpu_seconds() - cpu1
            due_ms = due.timestamp() * 1000
            stamps = sorted(ts for ts, _ in events)
            span = (stamps[-1] - due_ms) / 1000
            results["due_to_all_fired_s"] = span
            results["fires_per_s"] = n / span
            results["cpu_ms_per_fire"] = fire_cpu / n * 1000
            results["peak_rss_mb"] = member.peak_rss_mb()
            p50 = (stamps[len(stamps) // 2] - due_ms) / 1000
            print(
                f"fire: {len(events):,} events, due -> all on the events topic {span:.2f} s "
                f"-> {n / span:,.0f} events/s (half by {p50:.2f} s); CPU while firing "
                f"{fire_cpu:.2f} s ({fire_cpu / n * 1000:.3f} ms per fired trigger); "
                f"peak RSS {member.peak_rss_mb():.0f} MB"
            )
            member.stop()
    finally:
        await producer.stop()
    return results


# -- latency: due-now request -> event on the events topic ------------------------------------


async def bench_latency(
    bootstrap: str, count: int, rate: float, workdir: Path, flags: Sequence[str]
) -> dict[str, float]:
    print(f"\n== latency: {count} due-now requests, one at a time, {rate:.0f}/s {' '.join(flags)}")
    settings = fresh_settings(bootstrap, 12)
    await ensure_topics(settings, topic_specs(settings))
    async with aiohttp.ClientSession() as session:
        member = Member(settings, "lat", workdir, *flags)
        try:
            await wait_for(session, member, "deferline_triggerer_assigned_partitions", 12)
            await asyncio.sleep(1.0)
            latencies = await probe_latency(settings, count, rate)
        finally:
            member.stop()
    p50, p99 = latency_quantiles(latencies)
    print(
        f"produce -> event read back: p50 {p50:.1f} ms, p99 {p99:.1f} ms, max "
        f"{latencies[-1] * 1000:.1f} ms, mean {statistics.mean(latencies) * 1000:.1f} ms "
        "(includes the reader's own fetch wait of 5 ms)"
    )
    return {"latency_p50_ms": p50, "latency_p99_ms": p99}


async def probe_latency(settings: Settings, count: int, rate: float) -> list[float]:
    """Publish ``count`` due-now DeferRequests one at a time, ``rate`` a second, to a running
    triggerer; each one's seconds from its send to its event read back, sorted."""
    names = TopicNames(settings.topic_prefix)
    producer = make_producer(settings, linger_ms=0)
    await producer.start()
    consumer = make_consumer(settings, names.resume(), group_id=None, fetch_max_wait_ms=5)
    await consumer.start()
    sent_at: dict[str, float] = {}
    latencies: list[float] = []
    try:

        async def read() -> None:
            while len(latencies) < count:
                batches = await consumer.getmany(timeout_ms=100)
                now = time.perf_counter()
                for records in batches.values():
                    for record in records:
                        event = decode(record.value)
                        if isinstance(event, TriggerEventRecord) and event.trigger_id in sent_at:
                            latencies.append(now - sent_at[event.trigger_id])

        reader = asyncio.create_task(read())
        for i in range(count):
            r = request(i, utcnow(), "lat")
            sent_at[r.trigger_id] = time.perf_counter()
            await (await producer.send(names.defer(), key=r.trigger_id.encode(), value=encode(r)))
            await asyncio.sleep(1 / rate)
        await asyncio.wait_for(reader, 60)
    finally:
        await consumer.stop()
        await producer.stop()
    return sorted(latencies)


def latency_quantiles(latencies: Sequence[float]) -> tuple[float, float]:
    """p50 and p99 of sorted latencies in seconds, in milliseconds."""
    return (
        latencies[len(latencies) // 2] * 1000,
        latencies[int(len(latencies) * 0.99) - 1] * 1000,
    )


# -- failover: SIGKILL and graceful stop -> triggers running on the survivor ------------------


async def bench_failover(
    bootstrap: str, n: int, session_timeout_ms: int, workdir: Path
) -> dict[str, float]:
    print(
        f"\n== failover: two members, {n:,} waiting triggers, session timeout "
        f"{session_timeout_ms} ms, heartbeat 1000 ms =="
    )
    results: dict[str, float] = {}
    flags = ("--session-timeout-ms", str(session_timeout_ms), "--heartbeat-interval-ms", "1000")
    for how, sig in (("SIGKILL", signal.SIGKILL), ("SIGTERM", signal.SIGTERM)):
        settings = fresh_settings(bootstrap, 12)
        await ensure_topics(settings, topic_specs(settings))
        producer = make_producer(settings, linger_ms=5)
        await producer.start()
        far = utcnow() + dt.timedelta(hours=1)
        await produce(
            producer,
            TopicNames(settings.topic_prefix).defer(),
            [request(i, far, how) for i in range(n)],
        )
        await producer.stop()
        async with aiohttp.ClientSession() as session:
            a = Member(settings, f"{how}-a", workdir, *flags)
            b = Member(settings, f"{how}-b", workdir, *flags)
            try:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    ma, mb = await a.metrics(session), await b.metrics(session)
                    parts = ma.get(
                        'deferline_triggerer_assigned_partitions{queue="default"}', 0
                    ) + mb.get('deferline_triggerer_assigned_partitions{queue="default"}', 0)
                    running = ma.get("deferline_triggers_running", 0) + mb.get(
                        "deferline_triggers_running", 0
                    )
                    if parts == 12 and running == n and ma.get("deferline_triggers_running"):
                        break
                    await asyncio.sleep(0.1)
                killed = time.monotonic()
                a.proc.send_signal(sig)
                running_at = await wait_for(
                    session, b, "deferline_triggers_running", n, within=120, interval=0.01
                )
                took = running_at - killed
                results[f"{how.lower()}_takeover_s"] = took
                print(
                    f"{how} of one member -> all {n:,} triggers running on the other: {took:.2f} s"
                )
            finally:
                a.stop(signal.SIGKILL)
                b.stop()
    return results


# -- burst: memory curve while N timers fall due at once; idle CPU ---------------------------


def cheap_requests(n: int, moment: dt.datetime, run: str) -> list[tuple[bytes, bytes]]:
    """``n`` valid DeferRequests built from one model's JSON (a million models take minutes)."""
    template = orjson.loads(encode(request(0, moment, run)))
    out = []
    for i in range(n):
        task = TaskKey(dag_id="bench", task_id="wait", run_id=f"{run}-{i}")
        trigger_id = make_trigger_id(task, 0)
        template["trigger_id"] = trigger_id
        template["task"]["run_id"] = task.run_id
        out.append((trigger_id.encode(), orjson.dumps(template)))
    return out


async def bench_burst(
    bootstrap: str, sizes: Sequence[int], workdir: Path, flags: Sequence[str]
) -> dict[str, float]:
    results: dict[str, float] = {}
    for n in sizes:
        print(f"\n== burst: {n:,} timers due at one moment, one member {' '.join(flags)} ==")
        settings = fresh_settings(bootstrap, 12)
        await ensure_topics(settings, topic_specs(settings))
        names = TopicNames(settings.topic_prefix)
        producer = make_producer(settings, linger_ms=5, max_batch_size=1 << 20)
        await producer.start()
        lead = 30.0 + n / 5000
        due = utcnow() + dt.timedelta(seconds=lead)
        try:
            await produce_batched(producer, names.defer(), cheap_requests(n, due, "burst"), 12)
        finally:
            await producer.stop()
        async with aiohttp.ClientSession() as session:
            member = Member(settings, f"burst{n}", workdir, "--capacity", str(n + 10), *flags)
            try:
                await wait_for(session, member, "deferline_triggers_running", n, within=lead)
                await asyncio.sleep(1.0)
                waiting = member.rss_mb()
                left = (due - utcnow()).total_seconds()
                if left < 0.5:
                    print(f"  (the member was not ready before the due time: {-left:.1f} s late)")
                await asyncio.sleep(max(0.0, left - 0.3))
                peak = waiting
                cpu0 = member.cpu_seconds()
                reader = asyncio.create_task(read_events(settings, n, within=600))
                while not reader.done():
                    peak = max(peak, member.rss_mb())
                    await asyncio.sleep(0.02)
                fire_cpu = member.cpu_seconds() - cpu0
                events = reader.result()
            finally:
                member.stop()
        stamps = sorted(ts for ts, _ in events)
        span = (stamps[-1] - due.timestamp() * 1000) / 1000 if stamps else float("nan")
        results[f"burst_{n}_rss_waiting_mb"] = waiting
        results[f"burst_{n}_rss_peak_mb"] = peak
        results[f"burst_{n}_events_per_s"] = len(events) / span
        results[f"burst_{n}_cpu_us_per_fire"] = fire_cpu / n * 1e6
        print(
            f"{len(events):,} events; due -> all on the events topic {span:.2f} s -> "
            f"{len(events) / span:,.0f} events/s; CPU {fire_cpu / n * 1e6:.0f} µs per fired "
            f"trigger; RSS waiting {waiting:.0f} MB, peak while firing {peak:.0f} MB "
            f"({peak / waiting:.2f}x)"
        )
    return results


async def bench_idle(bootstrap: str, workdir: Path, flags: Sequence[str]) -> dict[str, float]:
    print(f"\n== idle: one member on 12 empty partitions, 20 s {' '.join(flags)} ==")
    settings = fresh_settings(bootstrap, 12)
    await ensure_topics(settings, topic_specs(settings))
    async with aiohttp.ClientSession() as session:
        member = Member(settings, "idle", workdir, *flags)
        try:
            await wait_for(session, member, "deferline_triggerer_assigned_partitions", 12)
            await asyncio.sleep(3.0)
            cpu0, t0 = member.cpu_seconds(), time.monotonic()
            await asyncio.sleep(20.0)
            share = (member.cpu_seconds() - cpu0) / (time.monotonic() - t0)
        finally:
            member.stop()
    print(f"idle CPU: {share * 100:.2f} % of a core")
    return {"idle_cpu_percent": share * 100}


@contextlib.asynccontextmanager
async def _members_stopped() -> AsyncIterator[None]:
    """Whatever happens, no triggerer process outlives the benchmark."""
    try:
        yield
    finally:
        for member in _STARTED:
            member.stop(signal.SIGKILL)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=["tansu", "kafka"], default="tansu")
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--latency-count", type=int, default=1000)
    parser.add_argument("--latency-rate", type=float, default=100.0)
    parser.add_argument("--failover-n", type=int, default=10_000)
    parser.add_argument("--session-timeout-ms", type=int, default=6000)
    parser.add_argument("--only", default="throughput,latency,failover")
    parser.add_argument("--burst-sizes", default="10000,100000,1000000")
    parser.add_argument("--deferline", default=DEFERLINE, help="the executable to run")
    parser.add_argument(
        "--member-flags", default="", help="extra triggerer flags (latency, burst, idle)"
    )
    args = parser.parse_args()
    sitting = Sitting.begin("triggerer", broker=args.backend, deferline=args.deferline)
    flags = args.member_flags.split()
    Member.executable = args.deferline
    wanted = set(args.only.split(","))
    print(f"backend {args.backend}; python {sys.version.split()[0]}; {os.cpu_count()} cores")
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        async with cluster(args.backend) as bootstrap, _members_stopped():
            if "throughput" in wanted:
                results |= await bench_throughput(bootstrap, args.n, workdir)
            if "latency" in wanted:
                results |= await bench_latency(
                    bootstrap, args.latency_count, args.latency_rate, workdir, flags
                )
            if "failover" in wanted:
                results |= await bench_failover(
                    bootstrap, args.failover_n, args.session_timeout_ms, workdir
                )
            if "burst" in wanted:
                sizes = [int(size) for size in args.burst_sizes.split(",")]
                results |= await bench_burst(bootstrap, sizes, workdir, flags)
            if "idle" in wanted:
                results |= await bench_idle(bootstrap, workdir, flags)
    print("\n== against Airflow 2.10.5 (ANCHORS.md) ==")
    if "fires_per_s" in results:
        print(
            f"fires/s: {results['fires_per_s']:,.0f} vs {AIRFLOW['fires_per_s_10k']:.0f} "
            f"-> {results['fires_per_s'] / AIRFLOW['fires_per_s_10k']:.0f}x"
        )
        print(
            f"CPU per fired trigger: {results['cpu_ms_per_fire']:.3f} ms vs "
            f"{AIRFLOW['cpu_ms_per_fire']} ms -> "
            f"{AIRFLOW['cpu_ms_per_fire'] / max(results['cpu_ms_per_fire'], 1e-9):.0f}x less"
        )
    if "latency_p99_ms" in results:
        low, high = AIRFLOW["overhead_s"]
        p99 = results["latency_p99_ms"] / 1000
        print(
            f"due-now request -> event p99 {p99 * 1000:.1f} ms vs Airflow's {low}-{high} s "
            f"defer/resume overhead -> {low / p99:.0f}-{high / p99:.0f}x"
        )
    if "sigkill_takeover_s" in results:
        print(
            f"failover after SIGKILL: {results['sigkill_takeover_s']:.1f} s vs "
            f"{AIRFLOW['failover_s']} s -> "
            f"{AIRFLOW['failover_s'] / results['sigkill_takeover_s']:.1f}x"
        )
    sitting.write(_figures(args, results))


def _figures(args: argparse.Namespace, results: dict[str, float]) -> list[Figure]:
    """The claims of a run, from what it printed."""
    anchors = "anchors, an earlier sitting"
    flags = f"member flags `{args.member_flags}`; " if args.member_flags else ""
    figures = []
    n = args.n
    if "bootstrap_s" in results:
        figures += [
            Figure(
                f"triggerer.bootstrap_{size_slug(n)}",
                f"a triggerer starting on {n:,} active triggers: bootstrap (assignment → all "
                "running)",
                round(results["bootstrap_s"], 2),
                "s",
            ),
            Figure(
                f"restart.triggerer_{size_slug(n)}",
                f"a triggerer of {n:,} active triggers restarted from its checkpoints: "
                "assignment → all running",
                round(results["bootstrap_checkpoint_s"], 2),
                "s",
            ),
            Figure(
                "triggerer.deferrals_in",
                "deferrals read and started, live, a worker's DeferRequests",
                round(results["ingest_per_s"]),
                "/s",
                note=f"at {n:,}, {results['ingest_cpu_us']:.0f} µs CPU each",
            ),
            Figure(
                "triggerer.events_out",
                f"events/s out, {n:,} due at once (throughput case)",
                round(results["fires_per_s"]),
                "/s",
                note=f"{results['cpu_ms_per_fire'] * 1000:.0f} µs CPU per fired trigger; "
                f"Airflow 2.10.5: {AIRFLOW['fires_per_s_10k']:.0f}/s at 10,000, {anchors}",
            ),
        ]
    if "latency_p99_ms" in results:
        low, high = AIRFLOW["overhead_s"]
        figures.append(
            Figure(
                "triggerer.due_now_latency",
                f"due-now DeferRequest → event read back, {args.latency_count:,} at "
                f"{args.latency_rate:.0f}/s: p50 / p99",
                f"{results['latency_p50_ms']:.1f} / {results['latency_p99_ms']:.1f}",
                "ms",
                note=f"{flags}Airflow: {low} to {high} s per defer/resume cycle, {anchors}",
            )
        )
    for how in ("sigkill", "sigterm"):
        if f"{how}_takeover_s" in results:
            figures.append(
                Figure(
                    f"failover.triggerer_{how}",
                    f"{how.upper()} of one of two triggerers → all {args.failover_n:,} triggers "
                    f"running on the other ({args.session_timeout_ms / 1000:g} s session "
                    "timeout, 1 s heartbeat)",
                    round(results[f"{how}_takeover_s"], 2),
                    "s",
                    note=f"Airflow: ≈ {AIRFLOW['failover_s']} s, {anchors}"
                    if how == "sigkill"
                    else "",
                )
            )
    for size in [int(s) for s in args.burst_sizes.split(",")]:
        if f"burst_{size}_events_per_s" not in results:
            continue
        waiting, peak = (
            results[f"burst_{size}_rss_waiting_mb"],
            results[f"burst_{size}_rss_peak_mb"],
        )
        figures.append(
            Figure(
                f"triggerer.burst_{size_slug(size)}",
                f"{size:,} timers due at once in one member: events out",
                round(results[f"burst_{size}_events_per_s"]),
                "/s",
                note=f"{flags}{results[f'burst_{size}_cpu_us_per_fire']:.0f} µs CPU per fired "
                f"trigger; RSS waiting → peak {waiting:,.0f} → {peak:,.0f} MB "
                f"({peak / waiting:.2f}x)",
            )
        )
    if "idle_cpu_percent" in results:
        figures.append(
            Figure(
                "triggerer.idle_cpu",
                "idle member, 12 empty partitions",
                round(results["idle_cpu_percent"], 2),
                "% of a core",
                note=flags.removesuffix("; "),
            )
        )
    return figures


if __name__ == "__main__":
    asyncio.run(main())
