"""The Nexmark queries (``examples/nexmark``), exactly-once beside at-least-once, in one run.

The generator's events (``--events``, 4 partitions) go to one Kafka topic; each query runs
from it to a Kafka topic in both guarantees, alternating, ``--repeat`` times, in one Spark
session (after one warm-up run that is not counted). Prints events/s (whole run, and steady
state without the query's first micro-batch), the median and spread of the runs, events/s
per core (this machine's cores) and, beside it, the published anchor for the query: Flink
1.13 with exactly-once checkpoints and RocksDB on 8-core workers, per core, from the Nexmark
project's README (q0 155k, q1 158k, q4 34k, q5 22k, q7 12k, q18 54k, q20 19k events/s).

    python bench/nexmark.py [--events 200000] [--batch 50000] [--repeat 2]
        [--queries q0,q1,q2,q3,q4,q5,q6,q7,q8,q11,q18,q20] [--markdown FILE]

Latency at a steady rate, per query and guarantee (p50/p90/p99): ``python bench/nexmark.py
--latency [--rate 1000] [--seconds 30] [--queries ...]`` (``bench/nexmark_latency.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), ROOT]

import page  # noqa: E402
from exactly_once import services  # noqa: E402

from examples.nexmark.events import Config, to_kafka  # noqa: E402
from examples.nexmark.queries import QUERIES, kafka_events, query_pipeline  # noqa: E402
from onceflow import KafkaSink  # noqa: E402
from onceflow.connectors.kafka.connection import KafkaSettings  # noqa: E402
from onceflow.runtime.spark_env.session import DEFAULT_MASTER, spark_session  # noqa: E402

# Flink 1.13, exactly-once, RocksDB, events/s per core (the Nexmark project's README).
FLINK_PER_CORE = {
    "q0": 155_000,
    "q1": 158_000,
    "q4": 34_000,
    "q5": 22_000,
    "q7": 12_000,
    "q18": 54_000,
    "q20": 19_000,
}
GUARANTEES = ("at-least-once", "exactly-once")


def run_once(spark: Any, query: str, guarantee: str, args: Any, env: dict[str, Any]) -> dict:
    """One run of one query; events/s and the steady rate."""
    name = f"nx-{query}-{guarantee[:2]}-{uuid.uuid4().hex[:6]}"
    p = query_pipeline(query, kafka_events(env["topic"]), KafkaSink(f"{name}-out"), name)
    started = time.perf_counter()
    result = p.run(
        session=spark,
        redis_url=env["redis_url"],
        guarantee=guarantee,
        available_now=True,
        max_records_per_batch=args.batch,
        checkpoint=os.path.join(env["workdir"], name, "ckpt"),
        output_dir=os.path.join(env["workdir"], name),
        progress=False,
    )
    seconds = time.perf_counter() - started
    assert result.records_in == args.events, (result.records_in, args.events)
    history = result.extra["history"][1:]
    steady_n, steady_s = sum(n for _, n, _ in history), sum(s for _, _, s in history)
    return {"rate": args.events / seconds, "steady": steady_n / steady_s if steady_s else 0.0}


def table(runs: dict[str, dict[str, list[dict]]], args: Any) -> list[str]:
    cores = os.cpu_count() or 1

    def med(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    def cell(rs: list[dict], key: str) -> str:
        values = [r[key] for r in rs]
        return f"{med(rs, key):,.0f} ({min(values):,.0f}..{max(values):,.0f})"

    lines = [
        f"{args.events:,} Nexmark events, {args.repeat} run(s) per query and guarantee, "
        f"{cores} cores, median (min..max)",
        "",
        "| query | at-least-once events/s | exactly-once events/s | exactly-once / "
        "at-least-once | exactly-once steady | exactly-once per core | Flink 1.13 per core "
        "(published) |",
        "|---|---|---|---|---|---|---|",
    ]
    for query, by in runs.items():
        alo, eo = by["at-least-once"], by["exactly-once"]
        anchor = FLINK_PER_CORE.get(query)
        lines.append(
            f"| {query} | {cell(alo, 'rate')} | {cell(eo, 'rate')} | "
            f"{med(eo, 'rate') / med(alo, 'rate'):.0%} | {cell(eo, 'steady')} | "
            f"{med(eo, 'rate') / cores:,.0f} | {f'{anchor:,}' if anchor else '-'} |"
        )
    return lines


def main() -> None:
    if "--latency" in sys.argv:
        import nexmark_latency

        sys.argv.remove("--latency")
        nexmark_latency.main()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--queries", default=",".join(QUERIES))
    ap.add_argument("--markdown", help="also write the table into this page (## Nexmark)")
    args = ap.parse_args()
    queries = [q.strip() for q in args.queries.split(",") if q.strip()]
    with contextlib.ExitStack() as stack:
        redis_url, bootstrap, _ = stack.enter_context(services(False))
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="onceflow-nexmark-"))
        topic = f"nexmark-{uuid.uuid4().hex[:6]}"
        start = (int(time.time() * 1000) - 3_600_000) // 10_000 * 10_000
        to_kafka(KafkaSettings(bootstrap), topic, Config(events=args.events, start_ms=start))
        env = {"redis_url": redis_url, "topic": topic, "workdir": workdir}
        # the workers import the queries' combine functions from examples/ (as by name)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p
        )
        spark = spark_session(DEFAULT_MASTER, app_name="onceflow-bench-nexmark")
        run_once(spark, queries[0], "exactly-once", args, env)  # warm-up, not counted
        runs = {q: {g: [] for g in GUARANTEES} for q in queries}
        for round_ in range(args.repeat):
            for query in queries:
                order = GUARANTEES if round_ % 2 == 0 else GUARANTEES[::-1]
                for guarantee in order:
                    r = run_once(spark, query, guarantee, args, env)
                    runs[query][guarantee].append(r)
                    print(f"{query} {guarantee}: {r['rate']:,.0f} events/s", flush=True)
        lines = table(runs, args)
        print("\n".join(lines))
        if args.markdown:
            command = (
                f"Generated by `python bench/nexmark.py --events {args.events} --batch "
                f"{args.batch} --repeat {args.repeat} --queries {args.queries} --markdown "
                f"{args.markdown}` on {time.strftime('%Y-%m-%d')} (Spark `{DEFAULT_MASTER}`)."
            )
            page.replace_section(args.markdown, "## Nexmark", [command, "", *lines])


if __name__ == "__main__":
    main()
