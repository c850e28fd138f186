"""Where the Python time goes: a sampled profile of both modes of one benchmark workload.

Runs ``bench/exactly_once.py``'s child (one warm-up query, one measured query, in a fresh
Spark JVM) once per mode under ``py-spy record --subprocesses`` (``pip install py-spy``), so
every Python process of the run is sampled: the driver and Spark's Python workers. Each
sample is put in the category of the innermost frame that names one (Kafka consume, Kafka
produce, Redis calls, Bloom filters, ID derivation, encoding, Arrow, user code and combines,
Spark's worker plumbing); the table shows CPU seconds per category and process kind, both
modes side by side. Time Python spends waiting (for Redis replies, Kafka, the JVM) is not
CPU and is not counted: ``bench/exactly_once.py`` prints the Redis server's own CPU per
100k records (scripts, seen-mark writes) and its round trips per 1,000 records.
``--functions N`` adds the N worker functions whose self time grows most from
at-least-once to exactly-once (where to look next).

    python bench/profile_workers.py [--records 100000] [--batch 25000] [--rate 50]
        [--functions 40] [--workload keyed-count|keyed-count-ids|stateless|sliding-window|fan-out]

Uses REDIS_URL / KAFKA_BOOTSTRAP_SERVERS when set, else starts local ones.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.runtime.spark_env.session import DEFAULT_MASTER

BENCH = Path(__file__).with_name("exactly_once.py")
MODES = ("at-least-once", "exactly-once")
# (category, pattern on "function (file:line)"), tried from the innermost frame outwards.
CATEGORIES = [
    (
        "Kafka consume + decode",
        r"kafka/consumer|kafka/record|kafka/protocol|connectors/kafka/(worker|datasource|source)\.py",
    ),
    (
        "Kafka produce",
        r"kafka/producer|connectors/kafka/(sink|writer|transactional_\w+|delivery_log)\.py",
    ),
    (
        "Redis calls (client side, incl. Lua args)",
        r"/redis/|dedup/(commit|admission|delivery|trust|session)\.py|backup/store\.py",
    ),
    ("Bloom filters", r"pybloom|dedup/bloom\.py|dedup/addressing\.py"),
    ("ID derivation", r"kernel/ids\.py"),
    ("encode/decode values", r"kernel/codec\.py|msgpack|json/"),
    ("Arrow <-> Python", r"pyarrow|runtime/task\.py.*(to_arrow|rows|_rows)|pandas"),
    (
        "user functions, combines, windows",
        r"runtime/(body|combine_fn|windowing)\.py|e2e_pipelines|exactly_once\.py.*<lambda>",
    ),
    ("imports (Python processes starting)", r"<frozen (zipimport|importlib)"),
    ("Spark Python worker plumbing", r"pyspark/"),
    ("Onceflow task loop", r"runtime/|dedup/|kernel/"),
]
_COMPILED = [(name, re.compile(p)) for name, p in CATEGORIES]


IDLE = "idle (the worker daemon waiting for work)"


def classify(frames: list[str]) -> str:
    """The category of a stack (frames outermost first)."""
    code = [f for f in frames if not f.startswith("process ")]
    if code and code[-1].startswith("manager (daemon.py"):
        return IDLE  # select() in pyspark.daemon's loop: sampled although it sleeps
    for frame in reversed(frames):
        for name, pattern in _COMPILED:
            if pattern.search(frame):
                return name
    return "other (interpreter start, imports ...)"


def process_kind(frames: list[str]) -> str:
    """``worker`` for Spark's Python workers (forked by ``pyspark.daemon`` or Onceflow's warm
    daemon, :mod:`onceflow.runtime.spark_env.worker_daemon`), else ``driver``."""
    processes = [f for f in frames if f.startswith("process ")]
    last = processes[-1] if processes else ""
    daemons = ("pyspark.daemon", "pyspark/daemon", "worker_daemon")
    return "worker" if any(d in last for d in daemons) else "driver"


_LINE = re.compile(r":\d+\)$")


def parse_raw(path: Path, rate: int) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """CPU seconds per (process kind, category), and per worker function, from py-spy.

    The per-function time is the workers' self time (the innermost frame, line numbers
    dropped), from py-spy's raw (collapsed) output.
    """
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    functions: dict[str, float] = defaultdict(float)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        kind, category = process_kind(frames), classify(frames)
        seconds[(kind, category)] += int(count) / rate
        if kind == "worker" and category != IDLE:
            functions[_LINE.sub(")", frames[-1])] += int(count) / rate
    return seconds, functions


def profile_mode(
    mode: str, args: argparse.Namespace, env: dict[str, str]
) -> tuple[dict, dict, dict]:
    from exactly_once import child_command  # bench/ is on sys.path (see main)

    out = Path(tempfile.mkdtemp(prefix="onceflow-profile-")) / f"{mode}.txt"
    cmd = [
        shutil.which("py-spy") or "py-spy",
        "record",
        "--subprocesses",
        "--nonblocking",
        "--format",
        "raw",
        "--rate",
        str(args.rate),
        "--output",
        str(out),
        "--",
        *child_command(mode, args),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=1800)
    result = next(
        (json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")),
        None,
    )
    if result is None or not out.exists():
        msg = (
            f"profiled run of {mode} failed ({proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
        raise RuntimeError(msg)
    return (*parse_raw(out, args.rate), result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=25_000)
    parser.add_argument("--rate", type=int, default=50, help="samples per second per process")
    parser.add_argument("--master", default=DEFAULT_MASTER)
    sys.path.insert(0, str(BENCH.parent))
    from exactly_once import WORKLOADS

    parser.add_argument(
        "--workload",
        default="keyed-count",
        choices=list(WORKLOADS),
        help="the benchmark workload to profile (bench/exactly_once.py)",
    )
    parser.add_argument(
        "--functions",
        type=int,
        default=0,
        metavar="N",
        help="also list the N worker functions whose self time grows most from ALO to EO",
    )
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        sys.exit("py-spy is not installed: pip install py-spy")
    from exactly_once import produce_bids, services  # the benchmark's own input and services

    with services(False) as (redis_url, bootstrap, _):
        kafka = KafkaSettings.from_env(bootstrap)
        args.topic = f"profile-{uuid.uuid4().hex[:6]}"
        produce_bids(kafka, args.topic, args.records)
        env = {**os.environ, "REDIS_URL": redis_url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
        profiles, functions, results = {}, {}, {}
        for mode in MODES:
            t0 = time.perf_counter()
            profiles[mode], functions[mode], results[mode] = profile_mode(mode, args, env)
            print(
                f"profiled {mode} in {time.perf_counter() - t0:.0f} s "
                f"(measured query {results[mode]['rate']:,.0f} rec/s under the profiler)",
                flush=True,
            )
    report(profiles, results, args.records)
    if args.functions:
        report_functions(functions, args.records, args.functions)


def report(profiles: dict, results: dict, records: int) -> None:
    """CPU seconds per category, both modes side by side, per 100k records of one query."""
    # the child runs the query twice (warm-up + measured): per query = half
    scale = 100_000 / records / 2
    keys = sorted(
        {k for p in profiles.values() for k in p},
        key=lambda k: (k[0], -profiles[MODES[1]].get(k, 0)),
    )
    print()
    print("CPU seconds per 100k records (one query), sampled by py-spy")
    print(f"{'process':<8} {'category':<44} " + " ".join(f"{m:>15}" for m in MODES))
    for kind, cat in keys:
        if cat == IDLE:
            continue
        row = [profiles[m].get((kind, cat), 0.0) * scale for m in MODES]
        if max(row) < 0.05:
            continue
        print(f"{kind:<8} {cat:<44} " + " ".join(f"{v:>15.2f}" for v in row))
    for kind in ("driver", "worker"):
        totals = [
            sum(v for (k, c), v in profiles[m].items() if k == kind and c != IDLE) * scale
            for m in MODES
        ]
        print(f"{kind:<8} {'total':<44} " + " ".join(f"{v:>15.2f}" for v in totals))
    batches = [results[m]["batches"] for m in MODES]
    p50 = [results[m]["p50_s"] for m in MODES]
    print(
        f"{'':<8} {'micro-batches / p50 batch seconds':<44} "
        + " ".join(f"{b:>9} / {p:.2f}" for b, p in zip(batches, p50, strict=False))
    )


def report_functions(functions: dict[str, dict[str, float]], records: int, top: int) -> None:
    """The worker functions whose self time (per 100k records) grows most in exactly-once."""
    scale = 100_000 / records / 2
    names = {f for per_mode in functions.values() for f in per_mode}
    growth = sorted(
        names,
        key=lambda f: functions[MODES[0]].get(f, 0) - functions[MODES[1]].get(f, 0),
    )
    print()
    print(f"worker functions, self CPU seconds per 100k records (top {top} by growth)")
    print(f"{'function':<90} " + " ".join(f"{m:>15}" for m in MODES))
    for name in growth[:top]:
        row = [functions[m].get(name, 0.0) * scale for m in MODES]
        print(f"{name[:90]:<90} " + " ".join(f"{v:>15.3f}" for v in row))


if __name__ == "__main__":
    main()
