"""Local multi-process clusters: Spark standalone workers and a Redis Cluster, on loopback.

Each Spark job runs in a driver subprocess (``python -m tests.testing.test_cluster_services
SPEC``): a process holds one SparkContext, and the suite's session-wide ``local[2]`` session
may already live in this one. Tasks report the session id of the process running them,
which is the PID of the worker JVM that launched their executor, so the tests can tell
which worker ran what. One Spark cluster and one Redis Cluster serve the whole module;
function fixtures restart whatever an earlier test killed.

Measured times are printed to stderr (run with ``-s`` to see them).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from onceflow.testing import LocalRedisCluster, LocalSparkCluster, kill_session

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
DRIVER_MODULE = "tests.testing.test_cluster_services"
DRIVER_TIMEOUT_S = 300
EXECUTORS_TIMEOUT_S = 180
MARKER_TIMEOUT_S = 180
SPREAD_PARTITIONS = 8
SPREAD_SLEEP_S = 0.3
LOSS_PARTITIONS = 4
LOSS_SLEEP_S = 0.3
DOOMED_SLEEP_S = 120.0
"""Tasks on the worker to be killed sleep this long: still running when it dies."""
SPREAD_KEYS = 3000
TAGGED_KEYS = 50
WAIT_TIMEOUT_MS = 5000
EXECUTOR_MAIN_CLASS = "CoarseGrainedExecutorBackend"


def report(line: str) -> None:
    print(f"[cluster] {line}", file=sys.stderr)


# --- Spark: fixtures and the driver subprocess ------------------------------------------


@pytest.fixture(scope="module")
def spark_cluster_module() -> Iterator[LocalSparkCluster]:
    with LocalSparkCluster(workers=2) as cluster:
        report(f"Spark master + 2 workers ALIVE in {cluster.start_seconds:.1f} s")
        yield cluster


@pytest.fixture
def spark_cluster(spark_cluster_module: LocalSparkCluster) -> LocalSparkCluster:
    """The module's cluster with every worker running (an earlier test may have killed one)."""
    for index in range(spark_cluster_module.workers):
        if not spark_cluster_module.worker_alive(index):
            seconds = spark_cluster_module.restart_worker(index)
            report(f"worker {index} restarted and ALIVE in {seconds:.1f} s")
    return spark_cluster_module


@pytest.fixture
def drivers() -> Iterator[list[subprocess.Popen[str]]]:
    """Driver subprocesses a test started; any still running at teardown is killed whole."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            kill_session(proc.pid)
            proc.wait(10)


def start_driver(
    cluster: LocalSparkCluster,
    folder: Path,
    drivers: list[subprocess.Popen[str]],
    *,
    partitions: int,
    sleep_s: float,
    doomed_sid: int | None = None,
) -> subprocess.Popen[str]:
    spec = {
        "conf": cluster.session_conf(),
        "executors": cluster.workers,
        "markers": str(folder),
        "partitions": partitions,
        "sleep_s": sleep_s,
        "doomed_sid": doomed_sid,
    }
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    with (folder / "driver.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", DRIVER_MODULE, json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
    drivers.append(proc)
    return proc


def finish_driver(proc: subprocess.Popen[str], folder: Path) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=DRIVER_TIMEOUT_S)
    log = (folder / "driver.log").read_text(errors="replace")
    assert proc.returncode == 0, f"driver exited with {proc.returncode}:\n{log[-4000:]}"
    return dict(json.loads(out.strip().splitlines()[-1]))


def wait_for_task(
    folder: Path, proc: subprocess.Popen[str], wanted: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """The first task marker satisfying ``wanted``, written when the task started."""
    deadline = time.monotonic() + MARKER_TIMEOUT_S
    while time.monotonic() < deadline:
        for path in sorted(folder.glob("task-*.json")):
            row = json.loads(path.read_text())
            if wanted(row):
                return dict(row)
        if proc.poll() is not None:
            log = (folder / "driver.log").read_text(errors="replace")
            pytest.fail(f"driver exited ({proc.returncode}) before the task ran:\n{log[-4000:]}")
        time.sleep(0.05)
    pytest.fail(f"no matching task started within {MARKER_TIMEOUT_S} s; markers in {folder}")


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def record_task(
    marker_dir: str, sleep_s: float, doomed_sid: int | None, partition: int
) -> dict[str, Any]:
    """Runs in a Python worker: note where it runs (atomically), sleep, return the note.

    A task running under the worker about to be killed (session ``doomed_sid``) sleeps until
    the kill; the others finish quickly.
    """
    from pyspark import TaskContext

    context = TaskContext.get()
    attempt = context.attemptNumber() if context is not None else -1
    row = {"partition": partition, "attempt": attempt, "pid": os.getpid(), "sid": os.getsid(0)}
    path = Path(marker_dir, f"task-{partition}-{attempt}.json")
    path.with_suffix(".tmp").write_text(json.dumps(row))
    path.with_suffix(".tmp").rename(path)
    time.sleep(DOOMED_SLEEP_S if row["sid"] == doomed_sid else sleep_s)
    return row


def driver_main(spec: dict[str, Any]) -> None:
    """The driver subprocess: wait for every executor, run one job, print its rows as JSON."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("onceflow-cluster-test")
    for key, value in spec["conf"].items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    context = spark.sparkContext
    status = context._jsc.sc().getExecutorMemoryStatus  # block managers, the driver's included
    deadline = time.monotonic() + EXECUTORS_TIMEOUT_S
    while status().size() - 1 < spec["executors"]:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {status().size() - 1} executors registered")
        time.sleep(0.2)
    task = functools.partial(record_task, spec["markers"], spec["sleep_s"], spec["doomed_sid"])
    n = spec["partitions"]
    rows = context.parallelize(range(n), n).map(task).collect()
    print(json.dumps({"executors": status().size() - 1, "tasks": rows}), flush=True)
    spark.stop()


# --- Spark: tests -----------------------------------------------------------------------


@pytest.mark.long  # CI time (~19 s): the cluster tests of tests/cluster/ run jobs on both
def test_a_job_runs_on_both_workers(spark_cluster, drivers, tmp_path):
    started = time.monotonic()
    proc = start_driver(
        spark_cluster, tmp_path, drivers, partitions=SPREAD_PARTITIONS, sleep_s=SPREAD_SLEEP_S
    )
    result = finish_driver(proc, tmp_path)
    report(f"driver start + spread job: {time.monotonic() - started:.1f} s")

    assert result["executors"] == 2
    assert sorted(row["partition"] for row in result["tasks"]) == list(range(SPREAD_PARTITIONS))
    workers = {spark_cluster.worker_pid(0): 0, spark_cluster.worker_pid(1): 1}
    ran_on = Counter(workers.get(row["sid"]) for row in result["tasks"])
    assert set(ran_on) == {0, 1}, f"tasks per worker (None: not a worker's process): {ran_on}"


def test_a_job_survives_losing_a_worker(spark_cluster, drivers, tmp_path):
    victim, survivor = spark_cluster.worker_pid(0), spark_cluster.worker_pid(1)
    proc = start_driver(
        spark_cluster,
        tmp_path,
        drivers,
        partitions=LOSS_PARTITIONS,
        sleep_s=LOSS_SLEEP_S,
        doomed_sid=victim,
    )
    interrupted = wait_for_task(tmp_path, proc, lambda row: row["sid"] == victim)
    killed_at = time.monotonic()
    killed = spark_cluster.kill_worker(0)
    result = finish_driver(proc, tmp_path)
    report(
        f"worker 0 killed ({len(killed)} processes); job done "
        f"{time.monotonic() - killed_at:.1f} s later"
    )

    # The node is gone whole: worker JVM, executor JVM and the Python worker of the task.
    assert victim in killed
    assert interrupted["pid"] in killed
    assert [pid for pid, cmd in killed.items() if EXECUTOR_MAIN_CLASS in cmd], killed
    assert [pid for pid in killed if running(pid)] == []
    # Every partition finished; the interrupted one again, on the surviving worker.
    rows = {row["partition"]: row for row in result["tasks"]}
    assert sorted(rows) == list(range(LOSS_PARTITIONS))
    redone = rows[interrupted["partition"]]
    assert redone["sid"] == survivor
    assert redone["attempt"] > interrupted["attempt"]


def test_a_restarted_worker_registers_again(spark_cluster):
    before = {w["id"] for w in spark_cluster.alive_workers()}
    spark_cluster.kill_worker(0)
    assert len(spark_cluster.alive_workers()) == 1

    seconds = spark_cluster.restart_worker(0)
    report(f"worker restart until ALIVE: {seconds:.1f} s")

    alive = {w["id"] for w in spark_cluster.alive_workers()}
    assert len(alive) == 2
    assert len(alive - before) == 1, "the restarted worker registers under a new id"
    assert spark_cluster.worker_alive(0)


# --- Redis Cluster ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_cluster_module() -> Iterator[LocalRedisCluster]:
    with LocalRedisCluster() as cluster:
        report(
            f"Redis Cluster 3 masters + 3 replicas created and ok in {cluster.create_seconds:.1f} s"
        )
        yield cluster


@pytest.fixture
def redis_cluster(redis_cluster_module: LocalRedisCluster) -> LocalRedisCluster:
    """The module's cluster with every node running (an earlier test may have killed one)."""
    for port in redis_cluster_module.killed_ports():
        redis_cluster_module.restart_node(port)
    return redis_cluster_module


def owned_by(cluster: LocalRedisCluster, client: Any, keys: list[str]) -> dict[int, list[str]]:
    """Keys grouped by the port of the master serving their slot."""
    groups: dict[int, list[str]] = {}
    for key in keys:
        groups.setdefault(cluster.slot_owner(client.keyslot(key)).port, []).append(key)
    return groups


def test_cluster_client_spreads_keys_over_every_master(redis_cluster):
    client = redis_cluster.client(decode_responses=True)
    keys = [f"spread:{uuid.uuid4().hex[:8]}:{i}" for i in range(SPREAD_KEYS)]
    pipe = client.pipeline()
    for key in keys:
        pipe.set(key, key)
    pipe.execute()

    assert client.mget_nonatomic(keys) == keys
    groups = owned_by(redis_cluster, client, keys)
    assert set(groups) == {m.port for m in redis_cluster.masters()}
    for port, owned in groups.items():  # each key is stored on the master serving its slot
        node = redis_cluster.node_client(port).pipeline(transaction=False)
        for key in owned:
            node.exists(key)
        assert sum(node.execute()) == len(owned)
    stats = redis_cluster.node_stats()
    report("keys per node: " + ", ".join(f"{s.port}/{s.role}={s.keys}" for s in stats))
    assert all(s.keys > 0 for s in stats)


def keys_held(cluster: LocalRedisCluster, port: int, slot: int, keys: list[str]) -> int:
    """How many of ``keys`` node ``port`` stores in ``slot`` (other tests' keys may share it)."""
    node = cluster.node_client(port)
    stored = node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
    return len(set(node.execute_command("CLUSTER", "GETKEYSINSLOT", slot, stored)) & set(keys))


def test_keys_with_one_hash_tag_land_on_one_master(redis_cluster):
    client = redis_cluster.client(decode_responses=True)
    tag = uuid.uuid4().hex[:8]
    keys = [f"{{order-{tag}}}:line-{i}" for i in range(TAGGED_KEYS)]
    for key in keys:
        client.set(key, "x")

    slots = {client.keyslot(key) for key in keys}
    assert len(slots) == 1
    slot = slots.pop()
    owner = redis_cluster.slot_owner(slot)
    held = {m.port: keys_held(redis_cluster, m.port, slot, keys) for m in redis_cluster.masters()}
    assert held == {m.port: TAGGED_KEYS if m == owner else 0 for m in redis_cluster.masters()}


def test_failover_promotes_the_replica_and_keeps_waited_writes(redis_cluster):
    victim = redis_cluster.masters()[0]
    replica = next(r for r in redis_cluster.replicas() if r.master_id == victim.node_id)
    client = redis_cluster.client(decode_responses=True)
    keys = [f"durable:{uuid.uuid4().hex[:8]}:{i}" for i in range(SPREAD_KEYS)]
    groups = owned_by(redis_cluster, client, keys)
    for port, owned in groups.items():  # WAIT counts the writes of its own connection
        pipe = redis_cluster.node_client(port).pipeline(transaction=False)
        for key in owned:
            pipe.set(key, key)
        pipe.execute_command("WAIT", 1, WAIT_TIMEOUT_MS)
        assert pipe.execute()[-1] >= 1, f"no replica of {port} acknowledged the writes"

    killed = redis_cluster.kill_master(0)
    failover = redis_cluster.wait_failover()
    report(
        f"failover of master {killed.port} to {failover.promoted_port}: {failover.seconds:.2f} s"
    )

    assert killed.port == victim.port
    assert failover.promoted_port == replica.port
    assert redis_cluster.slot_owner(victim.slots[0][0]).port == replica.port
    fresh = redis_cluster.client(decode_responses=True)
    assert fresh.mget_nonatomic(keys) == keys
    lost_slot_key = groups[victim.port][0]
    fresh.set(lost_slot_key, "after-failover")
    assert fresh.get(lost_slot_key) == "after-failover"
    assert client.get(lost_slot_key) == "after-failover", "the old client follows the new master"


def test_a_restarted_master_rejoins_as_a_replica(redis_cluster):
    victim = redis_cluster.kill_master(1)
    failover = redis_cluster.wait_failover()
    seconds = redis_cluster.restart_node()
    report(f"killed master restarted and cluster settled in {seconds:.2f} s")

    promoted = next(n for n in redis_cluster.nodes() if n.port == failover.promoted_port)
    rejoined = {r.port: r for r in redis_cluster.replicas()}
    assert victim.port in rejoined
    assert rejoined[victim.port].master_id == promoted.node_id
    assert len(redis_cluster.masters()) == 3
    info = redis_cluster.node_client(victim.port).info("replication")
    assert (info["role"], info["master_link_status"]) == ("slave", "up")


if __name__ == "__main__":
    driver_main(json.loads(sys.argv[1]))
