"""Onceflow beside what users would pick instead: Quix Streams, Spark's operators and Flink.

One Apache Kafka broker (``LocalKafka``) and one Redis, the same input topic for every
system, runs alternating system by system (``--repeat`` rounds, the order reversed every
other round), each system in a fresh process tree (``bench/peer_jobs.py`` holds the programs):

* Onceflow exactly-once with IDs from ``event_id`` (``id=``: every event through the dedup)
  and at least once, with kafka-python (the default) and confluent-kafka (``client=``);
* Quix Streams (``pip install 'onceflow[bench]'``), ``processing_guarantee`` exactly-once
  and at-least-once;
* Spark Structured Streaming with its own Kafka source and sink (``spark-sql-kafka-0-10``
  4.2.0 from Maven Central on PySpark 4.3), without and with
  ``dropDuplicatesWithinWatermark(["event_id"])``; its Kafka sink is not transactional;
* Apache Flink 2.3 (the JVM anchor): Flink SQL through PyFlink in one local JVM, parallelism
  2, exactly-once checkpoints every ``--flink-checkpoint-ms`` (500 ms; why in
  ``bench/flink_peer.py``) committing Kafka transactions; PyFlink and its Kafka connector are
  fetched into a cache of their own on first use (they cannot share Onceflow's env).

A system that cannot run here is left out with the reason, printed (no Quix Streams
installed, no Kafka connector jar for Spark, PyFlink not installable ...).

Workload ``sum`` (the headline): ``--events`` JSON events ``{"user": "u17", "amount": n,
"event_id": ...}`` of 100 users on 4 partitions, a running total of ``amount`` per user to a
topic. Measured from outside, per run:

* *time to correct result*: from the system's process start until a ``read_committed``
  consumer of the output topic sees, for every user, a last total equal to the total
  computed independently while writing the input;
* *of which to first output*: from the process start until that consumer sees the first
  output record: the system's start-up (interpreters, JVM, consumer group, Spark session and
  query) plus its first step of work; the rest of the time to the correct result is the work;
* *steady records/s*: input records between 20% and 80% of the way, over the time between
  (how far is read off the output: the sum of the users' last totals over the final sum);
  from the last output seen below 20% to the first at 80% or more, so that output visible in
  steps (Quix exactly-once commits every 5 s, a micro-batch of ``--batch`` records) does not
  inflate it; still coarse when a run has few steps: read it with the run size in mind;
* *CPU s per 100k records*: user + system CPU of the run's process tree (driver, JVM,
  Python workers; Flink's: the PyFlink program and the JVM it starts), sampled every 0.5 s
  from /proc until the result is correct; the broker's and Redis's CPU in the same time
  beside it (Redis only serves Onceflow);
* *peak memory*: PSS (shared pages split between the processes sharing them) of the tree,
  the sum of the peaks of the driver, the JVM and the Python workers.

Workload ``copy`` (``--workloads sum,copy``): the stateless filter (one event in ten dropped)
and map, measured the same way (right: every kept ``event_id`` came out; copies counted).

Workload ``window`` (``--workloads window``): events per user in sliding windows of 10 s every
2 s of the events' time (1 s of lateness allowed), the final count of each window out; right
when every window ending 12 s before the last event time has its count.

Latency (``--latency``): the same copy, fed at ``--rate`` events/s
(each stamped with its send time); latency is the arrival time at a ``read_committed``
consumer minus the send time, p50/p90/p99 over ``--seconds`` after ``--warmup`` seconds
counted from the first arrival.

Every row gives its ratio to Onceflow exactly-once (kafka-python): above 1 is slower, more
CPU, more memory for times and costs, faster for records/s. Median of the runs, min–max.

    python bench/peers.py [--events 1000000] [--repeat 3] [--batch 50000]
        [--workloads sum,copy] [--systems onceflow-eo,onceflow-alo,...,flink]
        [--flink-checkpoint-ms 500]
        [--latency] [--rate 1000] [--seconds 30] [--quick] [--markdown docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import flink_peer
import page
from exactly_once import BROKER_PID_ENV, PeakRss, redis_cpu, services
from latency import Measured, _read_phases
from peer_jobs import STEP_MS, WINDOW_MS, keep
from teardown import own_session

from onceflow.connectors.kafka.admin import ensure_topics
from onceflow.connectors.kafka.connection import KafkaSettings

HERE = os.path.dirname(os.path.abspath(__file__))
USERS = 100
PARTITIONS = 4
HEADING = "## Peers"
STEP_GAP_S = 0.5  # outputs this close together came out in one step (steady_rate)


@dataclass(frozen=True)
class System:
    """One contender: a program of ``peer_jobs.py`` and its options."""

    key: str
    label: str
    program: str
    options: tuple[str, ...] = ()
    guarantee: str = ""


SYSTEMS = (
    System("onceflow-eo", "Onceflow exactly-once (id=)", "onceflow", (), "exactly-once"),
    System(
        "onceflow-alo",
        "Onceflow at-least-once",
        "onceflow",
        ("--guarantee", "at-least-once"),
        "at least once",
    ),
    System(
        "onceflow-eo-confluent",
        "Onceflow exactly-once, confluent-kafka",
        "onceflow",
        ("--client", "confluent"),
        "exactly-once",
    ),
    System("quix-eo", "Quix Streams exactly-once", "quix", (), "exactly-once"),
    System(
        "quix-alo",
        "Quix Streams at-least-once",
        "quix",
        ("--guarantee", "at-least-once"),
        "at least once",
    ),
    System("spark", "Spark Structured Streaming", "spark", (), "at least once (sink)"),
    System(
        "spark-dedup",
        "Spark + dropDuplicatesWithinWatermark(event_id)",
        "spark",
        ("--dedup",),
        "at least once (sink)",
    ),
    System("flink", "Apache Flink 2.3 SQL (PyFlink)", "flink", (), "exactly-once"),
)
BY_KEY = {s.key: s for s in SYSTEMS}
REFERENCE = "onceflow-eo"


def unavailable(system: System) -> str | None:
    """Why ``system`` cannot run on this machine (None: it can)."""
    if system.program == "quix" and importlib.util.find_spec("quixstreams") is None:
        return "Quix Streams is not installed (pip install 'onceflow[bench]')"
    if system.key.endswith("confluent") and importlib.util.find_spec("confluent_kafka") is None:
        return "confluent-kafka is not installed (pip install 'onceflow[fast]')"
    if system.program == "spark":
        from onceflow.connectors.kafka.spark_jars import connector_jars

        try:
            connector_jars()
        except Exception as exc:  # noqa: BLE001 - any failure to fetch the jar skips Spark
            return f"no Kafka connector jar for Spark: {str(exc).splitlines()[0]}"
    if system.program == "flink":
        return flink_peer.unavailable()
    return None


# -- the input -------------------------------------------------------------------------------


def producer(bootstrap: str) -> Any:
    from confluent_kafka import Producer

    conf = {"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all"}
    return Producer({**conf, "queue.buffering.max.messages": 500_000})


def send(prod: Any, topic: str, key: bytes, value: bytes) -> None:
    while True:
        try:
            prod.produce(topic, key=key, value=value)
            return
        except BufferError:
            prod.poll(0.05)


def event(n: int, rng: random.Random) -> dict[str, Any]:
    """The ``n``-th event; its event time steps 5 ms per event."""
    return {
        "user": f"u{rng.randrange(USERS)}",
        "amount": rng.randint(1, 100),
        "event_id": f"e{n}",
        "ts": 1_700_000_000_000 + 5 * n,
        "sent_ms": int(time.time() * 1000),
    }


@dataclass
class Input:
    """What was written, computed independently of every system: the answers to check."""

    totals: dict[str, int]  # running sum: the final total per user
    kept: int  # copy: events that pass the filter
    windows: dict[tuple[str, int], int]  # window: events per (user, window start)
    last_ts: int = 0  # the largest event time written

    def closed_windows(self) -> dict[tuple[str, int], int]:
        """The windows every system must have closed: ending 12 s before the last event time.

        The watermark stops 1 s (the lateness; 10 s in Spark's variant with
        ``dropDuplicatesWithinWatermark``) behind the largest event time, in Onceflow and
        Spark the smallest of the partitions' (which differ by a few events' times).
        """
        cutoff = self.last_ts - 12_000
        return {k: n for k, n in self.windows.items() if k[1] + WINDOW_MS <= cutoff}


def write_input(bootstrap: str, topic: str, events: int) -> Input:
    """Write ``events`` events keyed by user; return the independent answers."""
    ensure_topics(KafkaSettings(bootstrap), [topic], PARTITIONS)
    prod, rng = producer(bootstrap), random.Random(7)
    answers = Input({}, 0, {})
    for n in range(events):
        e = event(n, rng)
        answers.totals[e["user"]] = answers.totals.get(e["user"], 0) + e["amount"]
        answers.kept += keep(e)
        answers.last_ts = max(answers.last_ts, e["ts"])
        first = (e["ts"] - WINDOW_MS) // STEP_MS * STEP_MS + STEP_MS  # epoch-aligned starts
        for start in range(first, e["ts"] + 1, STEP_MS):
            answers.windows[e["user"], start] = answers.windows.get((e["user"], start), 0) + 1
        send(prod, topic, e["user"].encode(), json.dumps(e).encode())
        if n % 10_000 == 0:
            prod.poll(0)
    prod.flush(120)
    return answers


# -- the outside reader ----------------------------------------------------------------------


class Reader(threading.Thread):
    """A ``read_committed`` consumer of a run's output, handing each record to ``on_record``."""

    def __init__(self, bootstrap: str, topic: str, on_record: Callable[[Any, float], None]):
        super().__init__(daemon=True)
        from confluent_kafka import Consumer

        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"peers-{uuid.uuid4().hex[:8]}",
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 20,
                "topic.metadata.refresh.interval.ms": 1000,
            }
        )
        self.consumer.subscribe([topic])
        self.on_record = on_record
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            batch = self.consumer.consume(5000, 0.1)
            now = time.monotonic()
            for m in batch:
                if m.error() is None and m.value() is not None:
                    self.on_record(json.loads(m.value()), now)
        self.consumer.close()


@contextlib.contextmanager
def reading(bootstrap: str, topic: str, on_record: Callable[[Any, float], None]) -> Iterator[None]:
    """Inside: a :class:`Reader` of ``topic`` hands its records to ``on_record``."""
    reader = Reader(bootstrap, topic, on_record)
    reader.start()
    try:
        yield
    finally:
        reader.stop.set()
        reader.join(10)


class Check:
    """A run's output against the independent answers: progress over time, and when right."""

    def __init__(self) -> None:
        self.progress: list[tuple[float, float]] = []  # (monotonic time, fraction done)
        self.done_at: float | None = None
        self.duplicates = 0

    def advance(self, now: float, fraction: float, right: bool) -> None:
        self.progress.append((now, fraction))
        if right and self.done_at is None:
            self.done_at = now

    def status(self) -> str:
        return f"{self.progress[-1][1]:.0%} of the way" if self.progress else "no output"


class SumCheck(Check):
    """The running sum: right when every user's last total is the expected one."""

    def __init__(self, expected: dict[str, int]) -> None:
        super().__init__()
        self.expected = expected
        self.final = sum(expected.values())
        self.latest: dict[str, int] = {}
        self.reached = 0  # sum of the latest totals
        self.right = 0  # users whose latest total is the expected one

    def __call__(self, value: Any, now: float) -> None:
        user, total = value["user"], int(value["total"])
        old = self.latest.get(user)
        want = self.expected.get(user)
        self.right += (total == want) - (old is not None and old == want)
        self.reached += total - (old or 0)
        self.latest[user] = total
        self.advance(now, self.reached / self.final, self.right == len(self.expected))


class CopyCheck(Check):
    """The stateless copy: right when every kept event came out (copies counted)."""

    def __init__(self, kept: int) -> None:
        super().__init__()
        self.kept = kept
        self.seen: set[str] = set()

    def __call__(self, value: Any, now: float) -> None:
        before = len(self.seen)
        self.seen.add(value["event_id"])
        self.duplicates += len(self.seen) == before
        self.advance(now, len(self.seen) / self.kept, len(self.seen) == self.kept)


class WindowCheck(Check):
    """The sliding-window count: right when every closed window's last count is expected."""

    def __init__(self, expected: dict[tuple[str, int], int]) -> None:
        super().__init__()
        self.expected = expected
        self.latest: dict[tuple[str, int], int] = {}
        self.right = 0

    def __call__(self, value: Any, now: float) -> None:
        key = (value["user"], int(value["start"]))
        count, old = int(value["count"]), self.latest.get(key)
        want = self.expected.get(key)
        self.duplicates += old is not None
        self.right += (count == want) - (old is not None and old == want)
        self.latest[key] = count
        self.advance(now, self.right / len(self.expected), self.right == len(self.expected))


def check_for(workload: str, answers: Input) -> Check:
    if workload == "sum":
        return SumCheck(answers.totals)
    if workload == "copy":
        return CopyCheck(answers.kept)
    return WindowCheck(answers.closed_windows())


# -- one measured run ------------------------------------------------------------------------


@dataclass
class Result:
    system: str
    ok: bool
    seconds: float = 0.0  # process start to the correct result
    first: float = 0.0  # process start to the first output record seen (start-up + first step)
    steady: float = 0.0  # records/s between 20% and 80%
    cpu_100k: float = 0.0  # the tree's CPU s per 100k records
    services_100k: float = 0.0  # broker + Redis CPU s per 100k records
    memory_mb: float = 0.0
    duplicates: int = 0  # copy: records that came out more than once
    error: str = ""
    phases: dict[str, float] = field(default_factory=dict)  # Onceflow: median s per batch
    latencies: list[float] = field(default_factory=list)  # ms (latency runs)


@contextlib.contextmanager
def launched(
    system: System, workload: str, ctx: dict[str, str], out: str, work: str
) -> Iterator[subprocess.Popen[Any]]:
    """The system's program, output to ``work``/run.log, in a session killed on leaving."""
    python = flink_peer.flink_python() if system.program == "flink" else sys.executable
    cmd = [python, os.path.join(HERE, "peer_jobs.py"), system.program, workload]
    cmd += ["--bootstrap", ctx["bootstrap"], "--input", ctx["topic"], "--output", out]
    cmd += ["--work", work, "--redis-url", ctx["redis_url"], "--batch", ctx["batch"]]
    cmd += ["--checkpoint-ms", ctx["flink_checkpoint_ms"]] * (system.program == "flink")
    cmd += list(system.options)
    with (
        open(os.path.join(work, "run.log"), "w") as log,
        own_session(cmd, stdout=log, stderr=subprocess.STDOUT) as proc,
    ):
        yield proc


def tail(work: str, lines: int = 3) -> str:
    with open(os.path.join(work, "run.log"), errors="replace") as fh:
        text = [line.rstrip() for line in fh if line.strip()]
    return " | ".join(text[-lines:])


def steady_rate(progress: list[tuple[float, float]], events: int) -> float:
    """Input records/s from 20% to 80% of the way (0: not measurable).

    From the last observation before the step that crosses 20% (``STEP_GAP_S`` earlier) to
    the first at 80% or more: where output becomes visible in steps (a commit, a micro-batch),
    the records of a step were processed between the step before and it, so the rate is not
    inflated by steps that land close together.
    """
    start = next((i for i, (_, f) in enumerate(progress) if f >= 0.2), None)
    end = next((i for i, (_, f) in enumerate(progress) if f >= 0.8), None)
    if start is None or end is None:
        return 0.0
    before = [p for p in progress[:start] if p[0] < progress[start][0] - STEP_GAP_S]
    (t0, f0), (t1, f1) = (before[-1] if before else progress[0]), progress[end]
    return (f1 - f0) * events / (t1 - t0) if t1 > t0 else 0.0


def measure_run(system: System, workload: str, ctx: dict[str, str], answers: Input) -> Result:
    """One run of ``workload`` on ``system``, from its process start to the right output."""
    events = int(ctx["events"])
    work = tempfile.mkdtemp(prefix=f"peers-{system.key}-", dir=ctx["work"])
    out = f"peers-out-{uuid.uuid4().hex[:8]}"
    ensure_topics(KafkaSettings(ctx["bootstrap"]), [out], PARTITIONS)
    check = check_for(workload, answers)
    redis_before = redis_cpu(ctx["redis_url"]) or {"total": 0.0}
    broker = os.environ.get(BROKER_PID_ENV)
    with reading(ctx["bootstrap"], out, check):
        started = time.monotonic()
        with launched(system, workload, ctx, out, work) as proc:
            peak = PeakRss(proc.pid, others={"broker": int(broker)} if broker else {})
            deadline = started + float(ctx["timeout"])
            with peak:
                while check.done_at is None and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
            ended = proc.poll() is not None
    if check.done_at is None:
        why = "ended" if ended else "timed out"
        err = f"{why} before the output was right ({check.status()}): {tail(work)}"
        return Result(system.key, False, error=err)
    cpu = peak.cpu_seconds()
    redis_after = redis_cpu(ctx["redis_url"]) or {"total": 0.0}
    per = 100_000 / events
    return Result(
        system.key,
        True,
        seconds=check.done_at - started,
        first=check.progress[0][0] - started,
        steady=steady_rate(check.progress, events),
        cpu_100k=sum(v for k, v in cpu.items() if k != "broker") * per,
        services_100k=(cpu.get("broker", 0.0) + redis_after["total"] - redis_before["total"]) * per,
        memory_mb=sum(v for k, v in peak.peaks_mb().items() if k != "worker processes"),
        duplicates=check.duplicates,
        phases=batch_phases(work),
    )


def batch_phases(work: str) -> dict[str, float]:
    """Where an Onceflow micro-batch's time went (its driver's log), median s per phase."""
    measured = Measured("")
    _read_phases(work, measured)
    return {k: statistics.median(v) for k, v in measured.phases.items()}


# -- latency ---------------------------------------------------------------------------------


def measure_latency(system: System, ctx: dict[str, str], args: argparse.Namespace) -> Result:
    """The stateless copy at ``--rate`` events/s; latency send -> read_committed arrival."""
    work = tempfile.mkdtemp(prefix=f"peers-lat-{system.key}-", dir=ctx["work"])
    topic, out = (f"peers-lat-{k}-{uuid.uuid4().hex[:8]}" for k in ("in", "out"))
    ensure_topics(KafkaSettings(ctx["bootstrap"]), [topic, out], PARTITIONS)
    arrivals: list[tuple[float, float]] = []  # (send time s, latency ms)

    def on_record(value: Any, _: float) -> None:
        now = time.time() * 1000
        arrivals.append((value["sent_ms"] / 1000, now - value["sent_ms"]))

    window_start: float | None = None  # wall-clock time the measured window starts
    with (
        reading(ctx["bootstrap"], out, on_record),
        launched(system, "copy", {**ctx, "topic": topic}, out, work) as proc,
        feeding(ctx["bootstrap"], topic, args.rate),
    ):
        deadline = time.monotonic() + float(ctx["timeout"])
        while not arrivals and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if arrivals:
            window_start = time.time() + args.warmup
            time.sleep(args.warmup + args.seconds + args.drain)
    if window_start is None:
        return Result(system.key, False, error=f"no record came out: {tail(work)}")
    end = window_start + args.seconds
    window = [lat for sent, lat in list(arrivals) if window_start <= sent < end]
    return Result(system.key, bool(window), latencies=window)


@contextlib.contextmanager
def feeding(bootstrap: str, topic: str, rate: int) -> Iterator[None]:
    """Inside: :func:`feed` sends to ``topic`` in a thread of its own."""
    stop = threading.Event()
    feeder = threading.Thread(target=feed, args=(bootstrap, topic, rate, stop))
    feeder.start()
    try:
        yield
    finally:
        stop.set()
        feeder.join()


def feed(bootstrap: str, topic: str, rate: int, stop: threading.Event) -> None:
    """Send events at ``rate`` per second, each stamped with its send time, until ``stop``."""
    prod, rng = producer(bootstrap), random.Random(11)
    n, next_at = 0, time.time()
    while not stop.is_set():
        now = time.time()
        if now < next_at:
            time.sleep(next_at - now)
        e = event(n, rng)
        e["sent_ms"] = int(time.time() * 1000)
        send(prod, topic, e["user"].encode(), json.dumps(e).encode())
        prod.poll(0)
        n, next_at = n + 1, next_at + 1.0 / rate
    prod.flush(30)


# -- the table -------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def cell(values: list[float], ref: float | None, fmt: str) -> str:
    """``median (min–max) ×ratio`` of a measure (ratio to Onceflow exactly-once's median)."""
    if not values or (not any(values) and fmt != ".0f"):  # ".0f": a count, where 0 means none
        return "-"
    med = statistics.median(values)
    spread = f" ({min(values):{fmt}}–{max(values):{fmt}})" if len(values) > 1 else ""
    ratio = f" ×{med / ref:.2f}" if ref else ""
    return f"{med:{fmt}}{spread}{ratio}"


def run_table(runs: dict[str, list[Result]], skipped: dict[str, str], workload: str) -> list[str]:
    measures: tuple[tuple[str, str, str], ...] = (
        ("time to correct result, s", "seconds", ".1f"),
        ("of which to first output, s", "first", ".1f"),
        ("steady records/s", "steady", ",.0f"),
        ("CPU s / 100k records", "cpu_100k", ".1f"),
        ("broker + Redis CPU s / 100k", "services_100k", ".1f"),
        ("peak memory MB (PSS)", "memory_mb", ",.0f"),
    )
    if workload != "sum":
        measures += (("copies", "duplicates", ".0f"),)
    ref_runs = [r for r in runs.get(REFERENCE, []) if r.ok]
    refs = (
        {attr: statistics.median([getattr(r, attr) for r in ref_runs]) for _, attr, _ in measures}
        if ref_runs
        else {}
    )
    head = "| system | guarantee | " + " | ".join(m[0] for m in measures) + " |"
    lines = [head, "|" + "---|" * (len(measures) + 2)]
    for key, results in runs.items():
        ok = [r for r in results if r.ok]
        cells = [cell([getattr(r, a) for r in ok], refs.get(a), f) for _, a, f in measures]
        failed = len(results) - len(ok)
        note = f" ({failed} of {len(results)} runs failed)" if failed else ""
        lines.append(
            f"| {BY_KEY[key].label}{note} | {BY_KEY[key].guarantee} | " + " | ".join(cells) + " |"
        )
    lines += [
        f"| {BY_KEY[k].label} | skipped: {why} |" + " |" * len(measures)
        for k, why in skipped.items()
    ]
    errors = [(k, r.error) for k, rs in runs.items() for r in rs if not r.ok][:4]
    lines += ["", *(f"Failed run of {BY_KEY[k].label}: {e[:300]}" for k, e in errors)] * bool(
        errors
    )
    return lines


def latency_table(runs: dict[str, list[Result]], rate: int) -> list[str]:
    ref = [x for r in runs.get(REFERENCE, []) for x in r.latencies]
    lines = [
        f"| system (stateless copy, {rate:,} events/s) | p50 ms | p90 ms | p99 ms | records "
        "| p50 per run |",
        "|---|---|---|---|---|---|",
    ]
    for key, results in runs.items():
        lat = [x for r in results for x in r.latencies]
        if not lat:
            errors = "; ".join(r.error for r in results if r.error)[:200]
            lines.append(f"| {BY_KEY[key].label} | no records: {errors} | | | | |")
            continue
        qs = []
        for q in (0.5, 0.9, 0.99):
            ratio = f" ×{percentile(lat, q) / percentile(ref, q):.2f}" if ref else ""
            qs.append(f"{percentile(lat, q):,.0f}{ratio}")
        per_run = ", ".join(f"{percentile(r.latencies, 0.5):,.0f}" for r in results if r.latencies)
        lines.append(
            f"| {BY_KEY[key].label} | " + " | ".join(qs) + f" | {len(lat):,} | {per_run} |"
        )
    return lines


# -- main ------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=50_000, help="records per micro-batch at most")
    ap.add_argument("--systems", default=",".join(s.key for s in SYSTEMS))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    ap.add_argument("--workloads", default="sum", help="of sum, copy ('' for none: only --latency)")
    ap.add_argument("--latency", action="store_true", help="also the latency of the copy")
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--drain", type=float, default=10.0, help="waited for after the window")
    ap.add_argument(
        "--flink-checkpoint-ms",
        type=int,
        default=flink_peer.CHECKPOINT_MS,
        help="Flink's checkpoint interval: its latency and when its output becomes visible",
    )
    ap.add_argument("--quick", action="store_true", help="20k events, one round, 10 s latency")
    ap.add_argument("--markdown", help="write the tables into this page (## Peers)")
    args = ap.parse_args(argv)
    if args.quick:
        args.events, args.repeat, args.seconds, args.warmup, args.drain = 20_000, 1, 10, 5, 5
    return args


def rounds(keys: list[str], repeat: int) -> list[list[str]]:
    """The order of each round: alternating, reversed every other round."""
    return [keys if i % 2 == 0 else keys[::-1] for i in range(repeat)]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    load = os.getloadavg()
    wanted = [k.strip() for k in args.systems.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in BY_KEY]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; expected some of {', '.join(BY_KEY)}")
    skipped = {k: why for k in wanted if (why := unavailable(BY_KEY[k])) is not None}
    for key, why in skipped.items():
        print(f"skipped {BY_KEY[key].label}: {why}", flush=True)
    keys = [k for k in wanted if k not in skipped]
    if "flink" in keys:
        print(flink_note(args), flush=True)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    runs: dict[str, dict[str, list[Result]]] = {w: {k: [] for k in keys} for w in workloads}
    lats: dict[str, list[Result]] = {k: [] for k in keys}
    with contextlib.ExitStack() as stack:
        redis_url, bootstrap, _ = stack.enter_context(services(False))
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="onceflow-peers-"))
        ctx = {
            "bootstrap": bootstrap,
            "redis_url": redis_url,
            "batch": str(args.batch),
            "flink_checkpoint_ms": str(args.flink_checkpoint_ms),
            "events": str(args.events),
            "timeout": str(args.timeout),
            "work": work,
            "topic": f"peers-in-{uuid.uuid4().hex[:8]}",
        }
        if workloads:
            began = time.monotonic()
            answers = write_input(bootstrap, ctx["topic"], args.events)
            print(f"{args.events:,} events written in {time.monotonic() - began:.1f} s", flush=True)
        for workload in workloads:
            for i, order in enumerate(rounds(keys, args.repeat)):
                for key in order:
                    r = measure_run(BY_KEY[key], workload, ctx, answers)
                    runs[workload][key].append(r)
                    print(f"  {workload} round {i + 1} {key:<22} {progress_line(r)}", flush=True)
        if args.latency:
            for i, order in enumerate(rounds(keys, args.repeat)):
                for key in order:
                    r = measure_latency(BY_KEY[key], ctx, args)
                    lats[key].append(r)
                    p50 = f"p50 {percentile(r.latencies, 0.5):,.0f} ms" if r.latencies else r.error
                    print(f"  latency round {i + 1} {key:<22} {p50}", flush=True)
    report(args, runs, lats, skipped, load)


def flink_note(args: argparse.Namespace) -> str:
    """What Flink's row was measured with: its checkpoint interval decides its latency."""
    return (
        f"Apache Flink {flink_peer.FLINK_VERSION}: Flink SQL, parallelism "
        f"{flink_peer.PARALLELISM}, exactly-once checkpoints every "
        f"{args.flink_checkpoint_ms:,} ms (its Kafka transactions commit with each checkpoint: "
        "the interval is its latency; see bench/flink_peer.py)"
    )


def progress_line(r: Result) -> str:
    if not r.ok:
        return f"FAILED: {r.error}"
    return (
        f"correct after {r.seconds:.1f} s (first output {r.first:.1f} s), "
        f"steady {r.steady:,.0f} rec/s, "
        f"CPU {r.cpu_100k:.1f} s/100k, memory {r.memory_mb:,.0f} MB, {r.duplicates} copies"
        + ("; per batch " + ", ".join(f"{k} {v:.2f} s" for k, v in r.phases.items()))
        * bool(r.phases)
    )


def report(
    args: argparse.Namespace,
    runs: dict[str, dict[str, list[Result]]],
    lats: dict[str, list[Result]],
    skipped: dict[str, str],
    load: tuple[float, float, float],
) -> None:
    lines: list[str] = []
    titles = {
        "sum": "Running sum per user",
        "copy": "Stateless copy (filter + map)",
        "window": "Sliding-window count per user (10 s every 2 s)",
    }
    for workload, results in runs.items():
        lines += [
            f"{titles[workload]}, {args.events:,} events, {USERS} users, {PARTITIONS} "
            f"partitions, {args.repeat} round(s); median (min–max) ×ratio to Onceflow "
            "exactly-once",
            "",
            *run_table(results, skipped, workload),
            "",
        ]
    if args.latency:
        lines += [
            f"End-to-end latency, send -> read_committed arrival, {args.seconds:.0f} s after "
            f"{args.warmup:.0f} s of warm-up, {args.repeat} round(s)",
            "",
            *latency_table(lats, args.rate),
            "",
        ]
    if any(key == "flink" for results in (*runs.values(), lats) for key in results):
        lines += [flink_note(args), ""]
    print()
    print("\n".join(lines))
    if args.markdown:
        command = (
            f"Generated by `python bench/peers.py {' '.join(sys.argv[1:])}` on "
            f"{time.strftime('%Y-%m-%d')} ({os.cpu_count()} cores, load average {load[0]:.1f} "
            f"at the start, {os.getloadavg()[0]:.1f} at the end; one Apache Kafka broker and one "
            "Redis on the same machine). See the module docstring of `bench/peers.py` for what "
            "each column measures."
        )
        page.replace_section(args.markdown, HEADING, [command, "", *lines])


if __name__ == "__main__":
    main()
