"""A stage read by two others on a Spark standalone cluster (issue 37, R1).

``tests/e2e_pipelines/two_readers.py`` through ``onceflow run --master spark://...`` (master +
2 workers of one core): ``orders`` is persisted and read by the map stage of a keyed count and
by a merge after ``payments``. A worker killed mid-batch loses the cached blocks of ``orders``
it held; Spark computes them again in the other reader's task, at another index of another
union. Under its own partition that is one more attempt of the task (its outputs replayed from
its backup); under the reader's index it dropped every record as a copy, and both readers
lost them. Each run is checked against ``tests/exactly_once/two_readers.py``'s count of the
input.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from onceflow.testing.harness import Crash, crash_and_resume, run_pipeline
from onceflow.testing.spark_cluster import LocalSparkCluster
from tests.cluster.test_exactly_once_on_cluster import _kill_worker_running
from tests.exactly_once.two_readers import (
    ORDER_PARTITIONS,
    PIPELINE,
    TwoReaders,
    make_two_readers,
    verify,
)
from tests.fixtures.spark_cluster import cluster_cli_args, driver_env

pytestmark = [pytest.mark.cluster, pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]

RUN_TIMEOUT_S = 300


def report(line: str) -> None:
    print(f"[cluster] {line}", file=sys.stderr)


def on_cluster(scn: TwoReaders, cluster: LocalSparkCluster, extra: dict[str, str] | None = None):
    """The scenario's command line on the cluster."""
    args = scn.args()
    at = args.index("--master")
    del args[at : at + 2]
    return [*args, *cluster_cli_args(cluster, extra)]


PAUSE_S = 15  # longer than Spark's locality waits (3 s a level): the other worker moves on


@pytest.mark.long  # CI time (~55 s): R1's default tests are local (test_spark_partitions.py,
# test_two_readers.py's kill -9 and rerun); this is the same cause on a real cluster
@pytest.mark.parametrize("by_position", [False, True], ids=["ids", "positions"])
def test_two_executors_computing_one_partition_at_once_is_exact(
    standalone_cluster, broker, redis_server, tmp_path, by_position
):
    """Every task of ``orders`` in batch 1 pauses after its first commit.

    Both workers pause in the first reader's tasks of ``orders``; when one goes on to the
    other reader's map stage, that needs the partition still paused on the other worker, finds
    no cached block and computes it: two executors run one partition of ``orders`` at once.
    Under the stage's own partition these are two attempts of one task (the newer fences the
    older, what it committed is replayed); under the readers' indexes, the second dropped
    every record as a copy (IDs), or processed and delivered them again (positions).
    """
    started = time.monotonic()
    scn = make_two_readers(broker, redis_server.url, tmp_path, by_position=by_position)
    marker = str(tmp_path / "paused")
    crash = Crash("after_commit", stage="orders", batch=1, mode="pause")
    executor_env = {
        "spark.executorEnv.ONCEFLOW_CRASH": crash.env(),
        "spark.executorEnv.ONCEFLOW_CRASH_FILE": marker,
        "spark.executorEnv.ONCEFLOW_CRASH_PAUSE_S": str(PAUSE_S),
    }
    outcome = run_pipeline(
        PIPELINE,
        on_cluster(scn, standalone_cluster, executor_env),
        env={**scn.env, **driver_env()},
        timeout=RUN_TIMEOUT_S,
    ).check()
    assert outcome.returncode == 0
    sizes = verify(scn, redis_server.client())
    with open(marker, encoding="utf-8") as fh:
        paused = fh.read().splitlines()
    assert len(paused) > ORDER_PARTITIONS, f"no partition of orders ran twice: {paused}"
    report(
        f"two readers, {len(paused)} computations of {ORDER_PARTITIONS} partitions: run "
        f"{outcome.seconds:.1f} s, outputs {sizes}, test {time.monotonic() - started:.1f} s"
    )


@pytest.mark.long  # timing decides whether a lost block is computed again by the other reader
def test_a_worker_killed_while_a_stage_read_twice_is_cached_is_exact(
    standalone_cluster, broker, redis_server, tmp_path
):
    """``payments`` freezes in batch 1 (in the merge's map stage): its worker is killed with it.

    (Both sources are read by one scan, orders' topic partitions first: the payments stage's
    own partitions are 3 and 4.)

    By then the keyed count's map stage has run and cached ``orders`` on both workers; the
    merge's tasks that read the lost blocks compute them again on the surviving worker.
    """
    started = time.monotonic()
    scn = make_two_readers(broker, redis_server.url, tmp_path)
    scn.extra_env["TWO_READERS_SLOW_MS"] = "1"  # orders' tasks spread over both workers
    marker = str(tmp_path / "frozen")
    crash = Crash("after_commit", stage="payments", batch=1, partition=3)
    executor_env = {
        "spark.executorEnv.ONCEFLOW_CRASH": crash.env(),
        "spark.executorEnv.ONCEFLOW_CRASH_FILE": marker,
    }
    killed: list[int] = []
    killer = threading.Thread(
        target=_kill_worker_running, args=(standalone_cluster, marker, killed), daemon=True
    )
    killer.start()
    outcome = run_pipeline(
        PIPELINE,
        on_cluster(scn, standalone_cluster, executor_env),
        env={**scn.env, **driver_env()},
        timeout=RUN_TIMEOUT_S,
    ).check()
    killer.join(5)
    assert killed, "no task froze at the crash point:\n" + outcome.output[-3000:]
    assert outcome.returncode == 0
    sizes = verify(scn, redis_server.client())
    report(
        f"two readers, worker {killed[0]} killed mid-batch: run {outcome.seconds:.1f} s, "
        f"outputs {sizes}, test {time.monotonic() - started:.1f} s"
    )


@pytest.mark.long  # two cluster runs; the worker kill above proves the recomputation
@pytest.mark.parametrize("by_position", [False, True], ids=["ids", "positions"])
def test_a_stage_read_twice_killed_and_rerun_on_a_cluster_is_exact(
    standalone_cluster, broker, redis_server, tmp_path, by_position
):
    """Every process of the run killed with -9 once ``orders`` committed in batch 1."""
    started = time.monotonic()
    scn = make_two_readers(broker, redis_server.url, tmp_path, by_position=by_position)
    crash = Crash("after_commit", stage="orders", batch=1, partition=1)
    first, second = crash_and_resume(
        PIPELINE,
        crash,
        on_cluster(scn, standalone_cluster),
        env={**scn.env, **driver_env()},
        timeout=RUN_TIMEOUT_S,
    )
    assert first.crashed and second.returncode == 0
    sizes = verify(scn, redis_server.client())
    report(
        f"two readers killed and rerun: first run {first.seconds:.1f} s, resume "
        f"{second.seconds:.1f} s, outputs {sizes}, test {time.monotonic() - started:.1f} s"
    )
