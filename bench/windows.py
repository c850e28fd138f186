"""Sliding windows against a global keyed count on the same input, with Redis memory over time.

The input is ``--records`` events of ``--keys`` users over ``--hours`` of event time, up to
20 s out of order, on 4 partitions. Two exactly-once pipelines read it from the start, each in
a fresh process (a new Spark JVM):

* windowed: ``key_by(user) -> window(Sliding("10m", "1m")) -> count`` (each event lands in
  10 windows; every window's final pane is emitted and its state deleted when it closes);
* baseline: ``key_by(user) -> count_per_key`` (one running count per user, forever).

While each runs, ``onceflow gc`` passes run every ``--gc-every`` seconds (the dedup horizon
is ``--horizon`` of event time) and Redis is sampled every second: the series printed shows
records read so far, Redis's used memory, and the part held by keyed state (state hashes and
window timers) and by seen-IDs. The windowed pipeline's state must level off while the input
keeps coming (windows close behind the watermark), not grow with it.

    python bench/windows.py [--records 1000000] [--keys 1000] [--batch 50000]

Uses REDIS_URL / KAFKA_BOOTSTRAP_SERVERS when set, else starts local ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce
from onceflow.kernel.keyspace import Keyspace, Kind
from onceflow.kernel.scopes import read_scopes
from onceflow.kernel.settings import RedisSettings, redis_client
from onceflow.operations.gc import GcError, collect
from onceflow.runtime.spark_env.session import DEFAULT_MASTER
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.services import LocalRedis

PIPELINE = """
import os
from onceflow import DedupConfig, EventTime, KafkaSink, KafkaSource, Pipeline, Sliding

p = Pipeline(
    os.environ["BENCH_NAME"],
    dedup=DedupConfig.of(horizon=os.environ["BENCH_HORIZON"], bucket="10s"),
    event_time=EventTime.of(out_of_orderness="30s"),
)
keyed = p.read(
    "events", KafkaSource(os.environ["BENCH_TOPIC"], timestamp=lambda e: e["ts"])
).key_by("by-user", lambda e: e["user"])
if os.environ["BENCH_KIND"] == "windowed":
    keyed = keyed.window("window", Sliding("10m", "1m"))
keyed.count_per_key("count").write("counts", KafkaSink(os.environ["BENCH_TOPIC"] + "-out"))
"""

STATE_KINDS = (Kind.STATE, Kind.EVENT_TIMERS, Kind.PROCESSING_TIMERS, Kind.EXPIRY)


@dataclass
class Sample:
    seconds: float
    records: int
    used_mb: float
    state_mb: float
    seen_mb: float


@dataclass
class Run:
    kind: str
    seconds: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    batches: list[tuple[int, float]] = field(default_factory=list)  # records, seconds
    gc_passes: int = 0

    @property
    def steady(self) -> float:
        rest = self.batches[1:]
        seconds = sum(s for _, s in rest)
        return sum(n for n, _ in rest) / seconds if seconds else 0.0


def _mb(client: Any, ks: Keyspace, kinds: tuple[Kind, ...]) -> float:
    """MB of these kinds of keys in the namespace's tag and its partition scopes (one Redis)."""
    total = 0
    for tag in read_scopes(client, ks).keyspaces():
        for kind in kinds:
            for key in client.scan_iter(match=tag.pattern(kind), count=1000):
                total += client.memory_usage(key, samples=0) or 0
    return total / 1e6


def sample(client: Any, ks: Keyspace, t0: float) -> Sample:
    records = int(client.hget(ks.stats("events"), "in") or 0)
    used = int(client.info("memory")["used_memory"]) / 1e6
    return Sample(
        time.monotonic() - t0,
        records,
        used,
        _mb(client, ks, STATE_KINDS),
        _mb(client, ks, (Kind.SEEN,)),
    )


def run_one(kind: str, topic: str, args: argparse.Namespace, env: dict[str, str]) -> Run:
    name = f"bw-{kind[:3]}-{uuid.uuid4().hex[:6]}"
    work = tempfile.mkdtemp(prefix="onceflow-bench-windows-")
    path = os.path.join(work, "pipeline.py")
    with open(path, "w") as fh:
        fh.write(PIPELINE)
    child_env = {
        **env,
        "BENCH_NAME": name,
        "BENCH_TOPIC": topic,
        "BENCH_KIND": kind,
        "BENCH_HORIZON": args.horizon,
    }
    cmd = [
        sys.executable, "-m", "onceflow", "run", path, "--available-now",
        "--max-records-per-batch", str(args.batch), "--output-dir", os.path.join(work, "out"),
        "--master", args.master,
    ]  # fmt: skip
    client = redis_client(RedisSettings(env["REDIS_URL"]))
    ks = Keyspace(name)
    run = Run(kind)
    stop = threading.Event()

    def gc_loop() -> None:
        while not stop.wait(args.gc_every):
            with contextlib.suppress(GcError):
                collect(client, name)
                run.gc_passes += 1

    gc = threading.Thread(target=gc_loop, daemon=True)
    gc.start()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    while proc.poll() is None:
        time.sleep(1.0)
        with contextlib.suppress(Exception):
            run.samples.append(sample(client, ks, t0))
    run.seconds = time.monotonic() - t0
    stop.set()
    gc.join(30)
    reader.join(10)
    if proc.returncode != 0:
        msg = f"{kind} run failed ({proc.returncode}):\n{''.join(lines)[-3000:]}"
        raise RuntimeError(msg)
    run.samples.append(sample(client, ks, t0))
    for line in lines:  # "[name] batch 3: 50,000 records in, ... 4.2 s (11,905/s)"
        if "] batch " in line and " records in" in line:
            records = int(line.split(": ", 1)[1].split(" records")[0].replace(",", ""))
            seconds = float(line.rsplit(", ", 1)[1].split(" s ")[0])
            run.batches.append((records, seconds))
    return run


def produce_input(bootstrap: str, args: argparse.Namespace) -> str:
    topic = f"bw-{uuid.uuid4().hex[:6]}"
    rng = random.Random(7)
    base = (int(time.time()) // 3600 - int(args.hours) - 2) * 3_600_000
    step = args.hours * 3_600_000 / args.records
    records = (
        (
            None,
            json.dumps(
                {
                    "user": f"u{rng.randrange(args.keys)}",
                    "ts": int(base + i * step + rng.randrange(-20_000, 20_000)),
                }
            ).encode(),
            None,
        )
        for i in range(args.records)
    )
    t0 = time.perf_counter()
    produce(KafkaSettings.from_env(bootstrap), topic, records, partitions=4)
    print(f"produced {args.records:,} events in {time.perf_counter() - t0:.1f} s", flush=True)
    return topic


def report(runs: list[Run], records: int) -> None:
    print()
    print(f"{'pipeline':<12} {'seconds':>8} {'overall rec/s':>14} {'steady rec/s':>13} {'GC':>4}")
    for r in runs:
        print(
            f"{r.kind:<12} {r.seconds:>8.1f} {records / r.seconds:>14,.0f} {r.steady:>13,.0f} "
            f"{r.gc_passes:>4}"
        )
    for r in runs:
        print(f"\nRedis over time, {r.kind} (keyed state = state hashes + window timers):")
        print(f"{'s':>6} {'records read':>13} {'used MB':>8} {'state MB':>9} {'seen-IDs MB':>12}")
        step = max(1, len(r.samples) // 25)
        shown = r.samples[::step]
        if shown[-1] is not r.samples[-1]:
            shown.append(r.samples[-1])
        for s in shown:
            print(
                f"{s.seconds:>6.0f} {s.records:>13,} {s.used_mb:>8.1f} {s.state_mb:>9.2f} "
                f"{s.seen_mb:>12.2f}"
            )
        half = [s.state_mb for s in r.samples if s.records >= records // 2]
        if half:
            print(
                f"keyed state while the second half of the input was read: "
                f"{min(half):.2f} to {max(half):.2f} MB"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--hours", type=float, default=6.0, help="event time the input spans")
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--horizon", default="5m", help="dedup horizon (event time)")
    parser.add_argument("--gc-every", type=float, default=2.0)
    parser.add_argument("--master", default=DEFAULT_MASTER)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        redis_url = os.environ.get("REDIS_URL") or stack.enter_context(LocalRedis()).url
        bootstrap = (
            os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or stack.enter_context(LocalKafka()).bootstrap
        )
        topic = produce_input(bootstrap, args)
        env = {**os.environ, "REDIS_URL": redis_url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
        runs = []
        for kind in ("windowed", "global"):
            r = run_one(kind, topic, args, env)
            print(f"{kind}: {r.seconds:.1f} s, {len(r.batches)} batches", flush=True)
            runs.append(r)
        report(runs, args.records)


if __name__ == "__main__":
    main()
