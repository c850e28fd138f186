"""Apache Flink as a peer of ``bench/peers.py``: the JVM anchor, Flink SQL through PyFlink.

**The job.** What a Flink user writes for each workload of ``bench/peer_jobs.py``: Flink SQL
submitted through PyFlink's Table API, so that every record is handled in the JVM (a Python
UDF would measure PyFlink's Python bridge, not Flink). The input is a ``kafka`` table
(JSON values, from the earliest offset); ``sum`` is ``GROUP BY user`` into an ``upsert-kafka``
table (one ``{"user", "total"}`` per update, keyed by user), ``copy`` a ``WHERE`` and a
computed ``cents`` into a ``kafka`` table, ``window`` a ``HOP`` window table function (10 s
every 2 s, a watermark 1 s behind the event time) counted per user, its input read by one
source task (``scan.parallelism`` 1; see below). Every sink is written with
``sink.delivery-guarantee = exactly-once``: Kafka transactions committed when a checkpoint
completes, so an outside ``read_committed`` reader sees a record only after the checkpoint
that covers it.

**The checkpoint interval** decides both Flink's latency and when its exactly-once output
becomes visible: a record is seen after the checkpoint that follows it completes, on average
half an interval plus the checkpoint's own time (0.05-1 s here, more under load).
:data:`CHECKPOINT_MS` is 500 ms: what a Flink user who needs the end-to-end latency of the
other rows (Onceflow exactly-once p50 ~0.3 s, p99 ~0.5 s at 1,000 events/s on a quiet
machine; Spark's back-to-back micro-batches about the same) would set. Measured here on a
machine loaded by other work (load average 7-15 on 2 cores), 1 s gave Flink a p50 of 0.68 s
and a p99 of 1.3 s, 500 ms 0.44 s and 1.9 s, beside Onceflow's 0.6-1.1 s and 1.6-1.9 s in the
same runs; the time to a correct 1M-event sum did not move measurably between the two.
Intervals of 1 s are the short end of what production Flink jobs with exactly-once Kafka
sinks run (10 s to minutes are common where latency matters less); below ~0.5 s the fixed
costs of each checkpoint (a barrier through the whole job, one Kafka transaction per sink
task, a checkpoint written to durable storage) take a growing share.
``--flink-checkpoint-ms`` of ``bench/peers.py`` changes it, and the tables say which was
measured.

**Where it runs.** PyFlink's local mode: one JVM (Flink's MiniCluster, the counterpart of
Spark's ``local[2]``) started by the Python program, parallelism 2 (two cores), the
``hashmap`` state backend with checkpoints in a local folder, mini-batch aggregation off
(Flink's default: one output per input of the running sum, as Quix Streams does), a JVM heap
of 1 GB (:data:`JVM_HEAP`: Spark's local driver's default, and about what Flink's own
standalone defaults give a TaskManager and a JobManager together).

**One source task for the window.** With two source tasks, one run in two on a loaded
machine dropped early events as late (5 windows missing, 105 counts one short; no error, no
count of them in the output): the likely cause is a task that starts reading before the other
has its partitions, which moves the watermark past the other's first events. With one source
task, whose per-partition watermarks start together, none was dropped in 3 runs. A Flink user
catching up on a backlog has the same problem and the same remedy.

**Install.** ``apache-flink`` 2.3.0 cannot share a virtual env with Onceflow: it pins
``py4j`` 0.10.9.7 (PySpark 4 needs another), and Apache Beam 2.61 under it pins
``redis<6``, ``pyarrow<17`` and ``numpy<2.2``. So the benchmark makes a virtual env of its own
on first use, ``~/.cache/onceflow/pyflink-2.3.0/venv`` (~850 MB, ~35 s from PyPI), and
fetches the Kafka connector ``flink-sql-connector-kafka`` 5.0.0-2.2 (the newest on Maven
Central, built for Flink 2.2; no build for 2.3 there) once with ``mvn`` beside it.
``ONCEFLOW_PYFLINK_PYTHON`` (an interpreter with apache-flink 2.3.0) and
``ONCEFLOW_FLINK_KAFKA_JAR`` (the connector jar) skip the fetching.

This module runs in two interpreters: ``bench/peers.py`` (Onceflow's bench env) calls
:func:`unavailable`, :func:`flink_python` and :func:`connector_jar`; ``bench/peer_jobs.py
flink`` runs :func:`run` in the Flink env. Only the standard library is imported at the top.

    python bench/peer_jobs.py flink sum --bootstrap B --input T --output T2 --work DIR [--explain]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from peer_jobs import LATENESS_MS, STEP_MS, WINDOW_MS

FLINK_VERSION = "2.3.0"
PYFLINK = f"apache-flink=={FLINK_VERSION}"
CONNECTOR_GROUP, CONNECTOR_ARTIFACT = "org.apache.flink", "flink-sql-connector-kafka"
CONNECTOR_VERSION = "5.0.0-2.2"  # the newest on Maven Central; built for Flink 2.2
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
PYTHON_ENV, JAR_ENV = "ONCEFLOW_PYFLINK_PYTHON", "ONCEFLOW_FLINK_KAFKA_JAR"
CACHE = Path("~/.cache/onceflow") / f"pyflink-{FLINK_VERSION}"
CHECKPOINT_MS = 500  # see the module docstring: Flink's latency and visibility
PARALLELISM = 2  # two cores, as Spark's local[2]
JVM_HEAP = "-Xmx1g"
# Flink's Kafka sink asks for transactions of 1 h; a broker allows 15 min by default.
TRANSACTION_TIMEOUT_MS = 900_000
FETCH_TIMEOUT_S = 900.0


# -- the job definition (plain text; built without Flink) ------------------------------------


@dataclass(frozen=True)
class FlinkJob:
    """One workload as Flink SQL: the settings, the tables, and the ``INSERT`` that runs."""

    settings: dict[str, str]
    tables: tuple[str, ...]
    insert: str


def settings(work: str, jar: str, checkpoint_ms: int) -> dict[str, str]:
    """The table environment's settings: exactly-once checkpoints every ``checkpoint_ms``."""
    return {
        "pipeline.name": f"peer-flink-{uuid.uuid4().hex[:6]}",
        "pipeline.jars": Path(jar).resolve().as_uri(),
        "parallelism.default": str(PARALLELISM),
        "execution.checkpointing.interval": f"{checkpoint_ms} ms",
        "execution.checkpointing.mode": "EXACTLY_ONCE",
        "execution.checkpointing.dir": Path(work, "checkpoints").resolve().as_uri(),
        "state.backend.type": "hashmap",
        "table.local-time-zone": "UTC",  # window starts as epoch milliseconds
    }


def interval(ms: int) -> str:
    """A SQL interval of ``ms`` milliseconds (Flink SQL has no MILLISECOND unit)."""
    return f"INTERVAL '{ms // 1000}.{ms % 1000:03d}' SECOND"


def _kafka(topic: str, bootstrap: str, **options: str) -> str:
    pairs = {"topic": topic, "properties.bootstrap.servers": bootstrap, **options}
    return ",\n  ".join(f"'{k}' = '{v}'" for k, v in pairs.items())


def source_table(topic: str, bootstrap: str, timed: bool) -> str:
    """The input: JSON events, read from the earliest offset; event time only when ``timed``."""
    watermark = (
        ",\n  event_time AS TO_TIMESTAMP_LTZ(ts, 3),\n"
        f"  WATERMARK FOR event_time AS event_time - {interval(LATENESS_MS)}"
        if timed
        else ""
    )
    options = _kafka(
        topic,
        bootstrap,
        connector="kafka",
        **{
            "properties.group.id": f"peer-flink-{uuid.uuid4().hex[:8]}",
            "scan.startup.mode": "earliest-offset",
            "format": "json",
            **({"scan.parallelism": "1"} if timed else {}),
        },
    )
    return (
        "CREATE TABLE events (\n  `user` STRING, amount BIGINT, event_id STRING, ts BIGINT, "
        f"sent_ms BIGINT{watermark}\n) WITH (\n  {options}\n)"
    )


def exactly_once(prefix: str) -> dict[str, str]:
    """A Kafka sink's options for transactions committed with each checkpoint."""
    return {
        "sink.delivery-guarantee": "exactly-once",
        "sink.transactional-id-prefix": prefix,
        "properties.transaction.timeout.ms": str(TRANSACTION_TIMEOUT_MS),
    }


def sink_table(workload: str, topic: str, bootstrap: str, prefix: str) -> tuple[str, str]:
    """The output table of ``workload`` and the ``INSERT`` filling it."""
    eo = exactly_once(prefix)
    if workload == "sum":
        options = _kafka(
            topic,
            bootstrap,
            connector="upsert-kafka",
            **{"key.format": "raw", "value.format": "json", **eo},
        )
        columns = "`user` STRING, total BIGINT, PRIMARY KEY (`user`) NOT ENFORCED"
        query = "SELECT `user`, SUM(amount) AS total FROM events GROUP BY `user`"
    else:
        options = _kafka(
            topic,
            bootstrap,
            connector="kafka",
            **{"key.format": "raw", "key.fields": "user", "value.format": "json", **eo},
        )
        columns, query = _append_sink(workload)
    table = f"CREATE TABLE output (\n  {columns}\n) WITH (\n  {options}\n)"
    return table, f"INSERT INTO output\n{query}"


def _append_sink(workload: str) -> tuple[str, str]:
    if workload == "copy":
        columns = (
            "`user` STRING, amount BIGINT, event_id STRING, ts BIGINT, sent_ms BIGINT, cents BIGINT"
        )
        query = (
            "SELECT `user`, amount, event_id, ts, sent_ms, amount * 100 AS cents FROM events "
            "WHERE amount % 10 <> 0"
        )
        return columns, query
    # Window starts as epoch milliseconds (the session's time zone is UTC; starts are whole
    # seconds, so a difference in seconds is exact).
    start = "CAST(TIMESTAMPDIFF(SECOND, TIMESTAMP '1970-01-01 00:00:00', window_start) AS BIGINT)"
    query = (
        f"SELECT `user`, {start} * 1000 AS `start`, COUNT(*) AS `count`\n"
        f"FROM TABLE(HOP(TABLE events, DESCRIPTOR(event_time), {interval(STEP_MS)}, "
        f"{interval(WINDOW_MS)}))\n"
        "GROUP BY `user`, window_start, window_end"
    )
    return "`user` STRING, `start` BIGINT, `count` BIGINT", query


def job(args: argparse.Namespace, jar: str) -> FlinkJob:
    """The Flink SQL job of ``args.workload`` between ``args.input`` and ``args.output``."""
    prefix = f"peer-flink-{uuid.uuid4().hex[:8]}"  # a run's own transactional ids
    table, insert = sink_table(args.workload, args.output, args.bootstrap, prefix)
    source = source_table(args.input, args.bootstrap, timed=args.workload == "window")
    checkpoint_ms = args.checkpoint_ms or CHECKPOINT_MS
    return FlinkJob(settings(args.work, jar, checkpoint_ms), (source, table), insert)


# -- running it (in the Flink env) -----------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    """Submit the job to a local MiniCluster and wait (``--explain``: print its plan, no job)."""
    os.environ.setdefault("JVM_ARGS", JVM_HEAP)  # read when PyFlink starts its JVM
    os.environ.setdefault("FLINK_LOG_DIR", args.work)  # the JVM's log, beside the run's
    from pyflink.table import EnvironmentSettings, TableEnvironment

    definition = job(args, connector_jar())
    t_env = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    config = t_env.get_config()
    for key, value in definition.settings.items():
        config.set(key, value)  # pipeline.jars: also onto the planner's class loader
    for ddl in definition.tables:
        t_env.execute_sql(ddl)
    if args.explain:
        print(t_env.explain_sql(definition.insert), flush=True)
        return
    result = t_env.execute_sql(definition.insert)
    every = definition.settings["execution.checkpointing.interval"]
    print(f"peer: flink job submitted, checkpoints every {every}", flush=True)
    result.wait()


# -- fetching Flink (in Onceflow's bench env) ------------------------------------------------


def unavailable() -> str | None:
    """Why Flink cannot run here (None: it can), after fetching what it needs once."""
    try:
        flink_python()
        connector_jar()
    except FetchError as exc:
        return str(exc)
    return None


class FetchError(RuntimeError):
    """PyFlink or its Kafka connector could not be had."""


def flink_python() -> str:
    """An interpreter with PyFlink: ``$ONCEFLOW_PYFLINK_PYTHON`` or a venv made once."""
    override = os.environ.get(PYTHON_ENV)
    if override:
        return override
    home = CACHE.expanduser()
    python = home / "venv" / "bin" / "python"
    done = home / "venv" / ".installed"
    if done.exists():
        return str(python)
    home.mkdir(parents=True, exist_ok=True)
    with _locked(home / ".fetch.lock"):
        if not done.exists():
            _make_venv(home / "venv")
            done.write_text(PYFLINK + "\n", encoding="utf-8")
    return str(python)


def _make_venv(venv: Path) -> None:
    print(f"peers: installing {PYFLINK} into {venv} (once; ~850 MB)", file=sys.stderr, flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    steps = (
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", PYFLINK],
    )
    for step in steps:
        done = _call(step)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            msg = (
                f"could not install {PYFLINK} into {venv} with {' '.join(step)} (expected exit "
                f"0, got {done.returncode}): {' | '.join(tail)}; set {PYTHON_ENV} to a Python "
                "that has it"
            )
            raise FetchError(msg)


def connector_jar() -> str:
    """The Kafka connector's jar: ``$ONCEFLOW_FLINK_KAFKA_JAR`` or fetched once with ``mvn``."""
    override = os.environ.get(JAR_ENV)
    if override:
        return override
    home = CACHE.expanduser()
    jar = home / f"{CONNECTOR_ARTIFACT}-{CONNECTOR_VERSION}.jar"
    if jar.exists():
        return str(jar)
    mvn = shutil.which("mvn")
    if mvn is None:
        msg = f"Maven ('mvn') is not installed to fetch {jar.name}; set {JAR_ENV} to the jar"
        raise FetchError(msg)
    home.mkdir(parents=True, exist_ok=True)
    artifact = f"{CONNECTOR_GROUP}:{CONNECTOR_ARTIFACT}:{CONNECTOR_VERSION}"
    step = [mvn, "-B", "-q", f"{DEPENDENCY_PLUGIN}:copy", f"-Dartifact={artifact}"]
    step.append(f"-DoutputDirectory={home}")
    with _locked(home / ".fetch.lock"):
        done = None if jar.exists() else _call(step)
    if not jar.exists():
        said = "" if done is None else (done.stdout + done.stderr).strip()[-300:]
        msg = f"could not fetch {artifact} with {' '.join(step)}: {said}; set {JAR_ENV}"
        raise FetchError(msg)
    return str(jar)


def _call(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, -1, "", f"timed out after {FETCH_TIMEOUT_S} s")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """A lock file, as onceflow.connectors.maven.locked (this module also runs in PyFlink's own
    interpreter, which has no onceflow to import)."""
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
