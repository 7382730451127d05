"""Does a loud trigger slow its triggerer? Due-now latency beside one, with --trigger-logs.

    python -m bench.bench_trigger_log_load [--backend tansu|kafka] [--rates 1000,10000]
        [--latency-count 1000] [--latency-rate 100]

For each rate, a fresh ``deferline triggerer --trigger-logs`` process (12 partitions) runs one
trigger (``bench._loud_trigger.LoudTrigger``) logging that many warning lines a second for
the whole probe, while due-now DeferRequests are published one at a time, 100 a second, and
each one's send → event read back is timed (as ``bench_triggerer --only latency``). Reported
per rate: p50 and p99 of that latency, against no loud trigger in the same sitting (a run
before the others and one after them, the better of the two), and the lines per second the
triggerer shipped to ``trigger.logs`` and dropped (its bound: 20,000 lines waiting), from its
metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from deferline.schemas import DeferRequest, TaskKey, encode
from deferline.topics import TopicNames, ensure_topics, make_producer, topic_specs

from bench._figures import Figure, Peer, Sitting
from bench._loud_trigger import LOUD
from bench.bench_triggerer import (
    Member,
    _members_stopped,
    cluster,
    fresh_settings,
    latency_quantiles,
    probe_latency,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
LINES = "deferline_triggerer_trigger_log_lines_total"
DROPPED = "deferline_triggerer_trigger_log_lines_dropped_total"


async def one_rate(
    bootstrap: str, rate: int, count: int, probe_rate: float, workdir: Path
) -> dict[str, float]:
    settings = fresh_settings(bootstrap, 12)
    await ensure_topics(settings, topic_specs(settings))
    seconds = count / probe_rate + 5
    async with aiohttp.ClientSession() as session:
        member = Member(settings, f"loud{rate}", workdir, "--trigger-logs")
        try:
            await wait_for(session, member, "deferline_triggerer_assigned_partitions", 12)
            if rate:
                loud = DeferRequest(
                    trigger_id=f"loud-{rate}",
                    task=TaskKey(dag_id="bench", task_id="loud", run_id=str(rate)),
                    classpath=LOUD,
                    kwargs={"rate": rate, "seconds": seconds},
                )
                producer = make_producer(settings)
                await producer.start()
                names = TopicNames(settings.topic_prefix)
                await producer.send_and_wait(
                    names.defer(), encode(loud), key=loud.trigger_id.encode()
                )
                await producer.stop()
            await asyncio.sleep(2.0)  # the loud trigger under way
            before = await member.metrics(session, LINES, DROPPED)
            start = time.monotonic()
            latencies = await probe_latency(settings, count, probe_rate)
            took = time.monotonic() - start
            after = await member.metrics(session, LINES, DROPPED)
        finally:
            member.stop()
    p50, p99 = latency_quantiles(latencies)
    shipped = (after.get(LINES, 0) - before.get(LINES, 0)) / took
    dropped = (after.get(DROPPED, 0) - before.get(DROPPED, 0)) / took
    print(
        f"{rate:,} lines/s logged: due-now p50 {p50:.1f} ms, p99 {p99:.1f} ms; "
        f"{shipped:,.0f} lines/s shipped, {dropped:,.0f}/s dropped"
    )
    return {"p50": p50, "p99": p99, "shipped": shipped, "dropped": dropped}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=["tansu", "kafka"], default="tansu")
    parser.add_argument("--rates", default="1000,10000,50000")
    parser.add_argument("--latency-count", type=int, default=1000)
    parser.add_argument("--latency-rate", type=float, default=100.0)
    args = parser.parse_args()
    rates = [0, *(int(r) for r in args.rates.split(",") if int(r))]
    sitting = Sitting.begin("trigger_log_load", broker=args.backend)
    os.environ["DEFERLINE_ALLOWED_TRIGGER_PREFIXES"] = "deferline.engine.triggers,bench"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    print(f"backend {args.backend}; python {sys.version.split()[0]}; {os.cpu_count()} cores")
    results: dict[int, dict[str, float]] = {}
    quiet_runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        async with cluster(args.backend) as bootstrap, _members_stopped():
            for rate in [*rates, 0]:  # the quiet run first and last: the sitting's drift
                got = await one_rate(
                    bootstrap, rate, args.latency_count, args.latency_rate, Path(tmp)
                )
                if rate:
                    results[rate] = got
                else:
                    quiet_runs.append(got)
    quiet = {q: min(run[q] for run in quiet_runs) for q in ("p50", "p99")}
    quiet_note = ", ".join(f"{run['p99']:.1f}" for run in quiet_runs)
    figures: list[Figure] = []
    for rate in rates[1:]:
        got = results[rate]
        figures.append(
            Figure(
                f"trigger_log_load.due_now_p99_{rate}",
                f"due-now DeferRequest → event, p99, beside a trigger logging {rate:,} lines/s "
                "(--trigger-logs)",
                round(got["p99"], 1),
                "ms",
                peer=Peer(
                    "no loud trigger, same sitting (the better of a run before and one after)",
                    round(quiet["p99"], 1),
                ),
                note=f"p50 {got['p50']:.1f} ms against {quiet['p50']:.1f} ms; quiet p99s: "
                f"{quiet_note} ms",
            )
        )
        figures.append(
            Figure(
                f"trigger_log_load.shipped_per_s_{rate}",
                f"a trigger logging {rate:,} lines/s: lines shipped to trigger.logs per second",
                round(got["shipped"]),
                "/s",
                note=f"dropped {got['dropped']:,.0f}/s (the bound: 20,000 waiting)",
            )
        )
    sitting.write(figures)


if __name__ == "__main__":
    asyncio.run(main())
