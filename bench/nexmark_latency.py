"""Nexmark latency: each query at a steady rate, exactly-once beside at-least-once.

A producer sends the generator's events (``examples/nexmark/events.py``) at ``--rate`` events/s
to a 4-partition topic, each stamped with the wall-clock time it is sent as its event time;
each query runs as a streaming query (``onceflow run examples/nexmark/queries.py
--trigger-seconds 0``) in both guarantees, alternating; an outside ``read_committed`` consumer
reads the query's output topic. A row's latency is its arrival time minus:

* for a row made from one event (q0, q1, q2, q18, q20): that event's time (its ``date_time``,
  or the ``onceflow-ts`` header the exactly-once sink writes); q20's bids wait for the
  watermark to pass them (the auction as of the bid's time), so its latency includes the 3 s
  of out-of-orderness, as a window's does;
* for a window's row (q5, q7, q11: the ``onceflow-window`` header; q8: its ``start`` + 10 s):
  the window's end in event time. This includes the out-of-orderness the watermark waits
  for before a window closes (3 s in these queries): a windowed query's latency cannot be
  lower than that.

Prints p50/p90/p99 per query and guarantee over ``--seconds`` after ``--warmup`` (rows whose
reference time falls in that span; windows end every 10 s, so keep ``--seconds`` >= 20 for
the windowed queries to have rows).

    python bench/nexmark_latency.py [--rate 1000] [--seconds 20] [--warmup 10]
        [--queries q0,q1,q2,q5,q7,q8,q11,q18,q20] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), ROOT]

import page  # noqa: E402
from exactly_once import services  # noqa: E402
from latency import Run, percentile  # noqa: E402

from examples.nexmark.events import Config, generate  # noqa: E402
from onceflow.connectors.kafka.clients import ensure_topics  # noqa: E402
from onceflow.connectors.kafka.connection import KafkaSettings  # noqa: E402
from onceflow.connectors.kafka.serialization import WINDOW_HEADER  # noqa: E402
from onceflow.kernel import ids  # noqa: E402

QUERIES_FILE = os.path.join(ROOT, "examples", "nexmark", "queries.py")
GUARANTEES = ("at-least-once", "exactly-once")
PARTITIONS = 4
WINDOW_MS = 10_000


def reference_ms(query: str, headers: dict[str, bytes], value: bytes | None) -> int | None:
    """The event time a row's latency is measured from (see the module docstring)."""
    window = headers.get(WINDOW_HEADER)
    if window is not None:
        return int(window.decode().split(",")[1])
    try:
        row = json.loads(value or b"null")
    except ValueError:
        return None
    if query == "q8" and isinstance(row, dict) and "start" in row:
        return int(row["start"]) + WINDOW_MS
    if isinstance(row, dict) and "date_time" in row:
        return int(row["date_time"])
    ts = headers.get(ids.TS_HEADER)
    return ids.parse_ts_header(ts) if ts is not None else None


class Traffic:
    """Nexmark events at a steady rate in; rows out, timed (librdkafka for both ends)."""

    def __init__(self, bootstrap: str, topic_in: str, topic_out: str, rate: int, query: str):
        from confluent_kafka import Consumer, Producer

        self.topic_in, self.rate, self.query = topic_in, rate, query
        self.producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 1})
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"nx-latency-{uuid.uuid4().hex[:8]}",
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 20,
            }
        )
        self.consumer.subscribe([topic_out])
        self.arrivals: list[tuple[float, float]] = []  # (reference time s, latency ms)
        self.sending = threading.Event()
        self.done = threading.Event()
        self.run_id = uuid.uuid4().hex[:6]
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._in, self._out)]
        for t in self.threads:
            t.start()

    def _in(self) -> None:
        self.sending.wait()
        events = generate(Config(events=10**9, seed=1, out_of_order=0.0))
        step, next_at, n = 1.0 / self.rate, time.time(), 0
        for generated in events:
            if self.done.is_set():
                break
            now = time.time()
            if now < next_at:
                time.sleep(next_at - now)
            event = {**generated, "date_time": int(time.time() * 1000)}
            event["event_id"] = f"{self.run_id}-{generated['event_id']}"
            value = json.dumps(event).encode()
            while True:
                try:
                    self.producer.produce(self.topic_in, value=value, partition=n % PARTITIONS)
                    break
                except BufferError:
                    self.producer.poll(0.01)
            self.producer.poll(0)
            n += 1
            next_at += step
        self.producer.flush(30)

    def _out(self) -> None:
        while not self.done.is_set():
            batch = [m for m in self.consumer.consume(1000, 0.1) if m.error() is None]
            now = time.time() * 1000
            for m in batch:
                ref = reference_ms(self.query, dict(m.headers() or []), m.value())
                if ref is not None:
                    self.arrivals.append((ref / 1000, now - ref))

    def between(self, start: float, end: float) -> list[float]:
        return [lat for ref, lat in self.arrivals if start <= ref < end]

    def close(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=30)
        self.consumer.close()


def measure(query: str, guarantee: str, args: Any, redis_url: str, bootstrap: str, work: str):
    name = f"nxl-{query}-{guarantee[:2]}-{uuid.uuid4().hex[:6]}"
    topic_in, topic_out = f"{name}-in", f"{name}-out"
    ensure_topics(KafkaSettings(bootstrap), [topic_in, topic_out], PARTITIONS)
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "REDIS_URL": redis_url,
        "NEXMARK_QUERY": query,
        "NEXMARK_TOPIC": topic_in,
        "NEXMARK_OUT": topic_out,
        "NEXMARK_PIPELINE": name,
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    }
    cmd = [sys.executable, "-m", "onceflow", "run", QUERIES_FILE, "--guarantee", guarantee]
    cmd += ["--trigger-seconds", "0", "--output-dir", os.path.join(work, name)]
    cmd += ["--checkpoint", os.path.join(work, name, "ckpt")]
    traffic = Traffic(bootstrap, topic_in, topic_out, args.rate, query)
    run = Run(cmd, env)
    try:
        run.first("first micro-batch starts")
        traffic.sending.set()
        t0 = time.time()
        time.sleep(args.warmup + args.seconds + (WINDOW_MS + 4_000) / 1000)
        return traffic.between(t0 + args.warmup, t0 + args.warmup + args.seconds)
    finally:
        traffic.close()
        run.stop()


def table(results: dict[str, dict[str, list[float]]], args: Any) -> list[str]:
    def cell(lat: list[float]) -> str:
        if not lat:
            return "no rows"
        return " / ".join(f"{percentile(lat, q):,.0f}" for q in (0.5, 0.9, 0.99))

    lines = [
        f"{args.rate:,} events/s for {args.seconds} s after {args.warmup} s of warm-up, "
        f"{PARTITIONS} partitions, trigger as fast as possible; latency p50 / p90 / p99 in ms "
        "(windowed queries: from the window's end, including the 3 s out-of-orderness)",
        "",
        "| query | at-least-once | exactly-once | rows measured (exactly-once) |",
        "|---|---|---|---|",
    ]
    for query, by in results.items():
        eo = by["exactly-once"]
        lines.append(f"| {query} | {cell(by['at-least-once'])} | {cell(eo)} | {len(eo):,} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--queries", default="q0,q1,q2,q5,q7,q8,q11,q18,q20")
    ap.add_argument("--markdown", help="also write the table into this page (## Nexmark latency)")
    args = ap.parse_args()
    queries = [q.strip() for q in args.queries.split(",") if q.strip()]
    results: dict[str, dict[str, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        redis_url, bootstrap, _ = stack.enter_context(services(False))
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="onceflow-nxl-"))
        for i, query in enumerate(queries):
            results[query] = {}
            for guarantee in GUARANTEES if i % 2 == 0 else GUARANTEES[::-1]:
                lat = measure(query, guarantee, args, redis_url, bootstrap, work)
                results[query][guarantee] = lat
                p99 = f"{percentile(lat, 0.99):,.0f} ms" if lat else "-"
                print(f"{query} {guarantee}: {len(lat)} rows, p99 {p99}", flush=True)
    lines = table(results, args)
    print("\n".join(lines))
    if args.markdown:
        command = (
            f"Generated by `python bench/nexmark_latency.py --rate {args.rate} --seconds "
            f"{args.seconds} --warmup {args.warmup} --queries {args.queries} --markdown "
            f"{args.markdown}` on {time.strftime('%Y-%m-%d')}."
        )
        page.replace_section(args.markdown, "## Nexmark latency", [command, "", *lines])


if __name__ == "__main__":
    main()
