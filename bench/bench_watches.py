"""Standing watches: what an event costs a triggerer, beside what a fired deferral costs.

    python -m bench.bench_watches [--backend tansu|kafka] [--n 100000] [--runs 3]

One ``deferline triggerer`` process (12 partitions). Each run publishes a WatchRequest run
once (``once``) whose trigger (``bench._watch_trigger.BurstWatch``) yields ``--n`` events as
fast as it can, and times it to the last WatchEvent on the resume topic (read_committed);
then, beside it in the same sitting, ``--n`` timers already due (DeferRequests of
DateTimeTrigger) fired by the same process. Both report the triggerer's CPU (user + system,
from /proc) per event and its RSS before and after, so the watch's per-event cost reads as a
ratio to a fired trigger's. A watch's events are one trigger's, so they go out of one
partition (one transaction at a time on Apache Kafka), where timers spread over all twelve.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from deferline.schemas import WatchRequest, encode, utcnow
from deferline.topics import TopicNames, ensure_topics, make_producer, topic_specs

from bench._figures import Peer, Sitting, runs_figure, size_slug
from bench._harness import produce_batched
from bench._watch_trigger import BURST
from bench.bench_triggerer import (
    Member,
    _members_stopped,
    cheap_requests,
    cluster,
    fresh_settings,
    read_events,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]


async def one_run(bootstrap: str, n: int, workdir: Path, run: int) -> dict[str, float]:
    settings = fresh_settings(bootstrap, 12)
    await ensure_topics(settings, topic_specs(settings))
    names = TopicNames(settings.topic_prefix)
    producer = make_producer(settings, linger_ms=5, max_batch_size=1 << 20)
    await producer.start()
    async with aiohttp.ClientSession() as session:
        member = Member(settings, f"watch{run}", workdir, "--capacity", str(n + 10))
        try:
            await wait_for(session, member, "deferline_triggerer_assigned_partitions", 12)
            await asyncio.sleep(1.0)
            # The watch: one trigger, n events.
            rss0, cpu0, start = member.rss_mb(), member.cpu_seconds(), time.monotonic()
            watch = WatchRequest(
                trigger_id=f"watch-{run}", classpath=BURST, kwargs={"n": n}, once=True
            )
            await producer.send_and_wait(
                names.defer(), encode(watch), key=watch.trigger_id.encode()
            )
            events = await read_events(settings, n, within=600)
            watch_s = time.monotonic() - start
            watch_cpu, rss1 = member.cpu_seconds() - cpu0, member.rss_mb()
            assert len(events) == n, f"{len(events)} watch events of {n}"
            # Beside it: n timers already due, in the same process.
            await asyncio.sleep(1.0)
            cpu1, start = member.cpu_seconds(), time.monotonic()
            due = utcnow() - dt.timedelta(seconds=1)
            await produce_batched(producer, names.defer(), cheap_requests(n, due, f"t{run}"), 12)
            events = await read_events(settings, 2 * n, within=600)
            timer_s = time.monotonic() - start
            timer_cpu = member.cpu_seconds() - cpu1
            assert len(events) == 2 * n, f"{len(events) - n} timer events of {n}"
        finally:
            member.stop()
            await producer.stop()
    result = {
        "watch_us": watch_cpu / n * 1e6,
        "watch_per_s": n / watch_s,
        "watch_rss_mb": rss1 - rss0,
        "timer_us": timer_cpu / n * 1e6,
        "timer_per_s": n / timer_s,
    }
    print(
        f"run {run}: watch {n:,} events in {watch_s:.2f} s ({result['watch_per_s']:,.0f}/s), "
        f"{result['watch_us']:.0f} µs CPU each, RSS {result['watch_rss_mb']:+.0f} MiB; "
        f"{n:,} timers fired in {timer_s:.2f} s, {result['timer_us']:.0f} µs CPU each"
    )
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=["tansu", "kafka"], default="tansu")
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sitting = Sitting.begin("watches", broker=args.backend)
    # The members import the bench's trigger: allowed, and on their path.
    os.environ["DEFERLINE_ALLOWED_TRIGGER_PREFIXES"] = (
        "deferline.engine.triggers,bench._watch_trigger"
    )
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    print(f"backend {args.backend}; python {sys.version.split()[0]}; {os.cpu_count()} cores")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        async with cluster(args.backend) as bootstrap, _members_stopped():
            for run in range(args.runs):
                runs.append(await one_run(bootstrap, args.n, Path(tmp), run))
    slug = size_slug(args.n)
    timer_us = sorted(r["timer_us"] for r in runs)[len(runs) // 2]
    timer_rate = sorted(r["timer_per_s"] for r in runs)[len(runs) // 2]
    sitting.write(
        [
            runs_figure(
                f"watches.cpu_per_event_{slug}",
                f"a standing watch yielding {args.n:,} events: triggerer CPU per event published",
                [round(r["watch_us"], 1) for r in runs],
                "µs",
                peer=Peer(
                    "a deferral already due, read and fired by the same process", round(timer_us, 1)
                ),
            ),
            runs_figure(
                f"watches.events_per_s_{slug}",
                f"a standing watch yielding {args.n:,} events: WatchRequest → last WatchEvent",
                [round(r["watch_per_s"]) for r in runs],
                "/s",
                peer=Peer(
                    f"{args.n:,} deferrals already due: published → fired", round(timer_rate)
                ),
                note="one trigger: one partition's producer (its transactions on Apache Kafka)",
            ),
            runs_figure(
                f"watches.rss_growth_{slug}",
                f"a standing watch yielding {args.n:,} events: triggerer RSS after minus before",
                [round(r["watch_rss_mb"], 1) for r in runs],
                "MiB",
            ),
        ]
    )


if __name__ == "__main__":
    asyncio.run(main())
