"""The exactly-once scenario on a Spark standalone cluster (master + 2 workers, loopback).

``tests/e2e_pipelines/orders.py`` runs through ``onceflow run --master spark://...`` with
the cluster's settings as ``--conf``. The workers were started without any ``KAFKA_*``
variable: the sinks must carry the driver's settings, and the pipeline's own module must be
shipped to the executors. Each run is checked against the scenario's independent count.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import pytest

from onceflow.testing.harness import Crash, crash_and_resume, run_pipeline
from onceflow.testing.spark_cluster import LocalSparkCluster
from tests.exactly_once.scenario import PIPELINE, make_scenario, verify
from tests.fixtures.spark_cluster import cluster_cli_args, driver_env

pytestmark = [pytest.mark.cluster, pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]

RUN_TIMEOUT_S = 240


def report(line: str) -> None:
    print(f"[cluster] {line}", file=sys.stderr)


def cluster_args(scn, cluster: LocalSparkCluster, extra_conf: dict[str, str] | None = None):
    """The scenario's command line, on the cluster instead of local mode."""
    args = list(scn.args)
    at = args.index("--master")
    del args[at : at + 2]
    return [*args, *cluster_cli_args(cluster, extra_conf)]


def cluster_env(scn) -> dict[str, str]:
    return {**scn.env, **driver_env()}


@pytest.mark.long  # the worker-kill test below runs the same pipeline to the end, verified
def test_clean_run_on_a_cluster_is_exact(standalone_cluster, broker, redis_server, tmp_path):
    started = time.monotonic()
    scn = make_scenario(broker, redis_server.url, tmp_path)
    outcome = run_pipeline(
        PIPELINE, cluster_args(scn, standalone_cluster), env=cluster_env(scn), timeout=RUN_TIMEOUT_S
    ).check()
    assert "duplicates dropped" in outcome.output
    verify(scn, redis_server.client())
    report(f"clean run {outcome.seconds:.1f} s, test {time.monotonic() - started:.1f} s")


def _kill_worker_running(cluster: LocalSparkCluster, marker: str, killed: list[int]) -> None:
    """Once a task froze (it wrote ``marker`` with its pid), kill -9 the worker running it."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        if os.path.exists(marker):
            found = re.search(r"pid=(\d+)", open(marker, encoding="utf-8").read())
            if found:
                pid = int(found.group(1))
                for index in range(cluster.workers):
                    if pid in cluster.worker_processes(index):
                        cluster.kill_worker(index)
                        killed.append(index)
                        return
        time.sleep(0.1)


def test_a_worker_killed_mid_batch_is_exact(standalone_cluster, broker, redis_server, tmp_path):
    """A task freezes after its (transactional) sink write; its worker is killed with it.

    Spark runs the task again on the other worker (attempt 1, which the crash point lets
    through); the new attempt fences the frozen one's Kafka transaction.
    """
    started = time.monotonic()
    scn = make_scenario(broker, redis_server.url, tmp_path)
    marker = str(tmp_path / "frozen")
    crash = Crash("after_sink_write", stage="events", batch=1, partition=0)
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
        cluster_args(scn, standalone_cluster, executor_env),
        env=cluster_env(scn),
        timeout=RUN_TIMEOUT_S,
    ).check()
    killer.join(5)
    assert killed, "no task froze at the crash point:\n" + outcome.output[-3000:]
    assert outcome.returncode == 0
    verify(scn, redis_server.client())
    report(
        f"worker {killed[0]} killed mid-batch: run {outcome.seconds:.1f} s, "
        f"test {time.monotonic() - started:.1f} s"
    )


@pytest.mark.long  # two cluster runs (~2.5 min); the local crash suite kills drivers too
def test_the_driver_killed_mid_batch_then_resumed_is_exact(
    standalone_cluster, broker, redis_server, tmp_path
):
    """Every process of the driver's side is killed while a task on a worker is mid-batch."""
    started = time.monotonic()
    scn = make_scenario(broker, redis_server.url, tmp_path)
    crash = Crash("after_commit", stage="events", batch=1, partition=0)
    first, second = crash_and_resume(
        PIPELINE,
        crash,
        cluster_args(scn, standalone_cluster),
        env=cluster_env(scn),
        timeout=RUN_TIMEOUT_S,
    )
    assert first.crashed and second.returncode == 0
    verify(scn, redis_server.client())
    report(
        f"driver killed: first run {first.seconds:.1f} s, resume {second.seconds:.1f} s, "
        f"test {time.monotonic() - started:.1f} s"
    )
