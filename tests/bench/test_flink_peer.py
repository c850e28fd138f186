"""The Flink peer of ``bench/peers.py`` (``bench/flink_peer.py``): its job definition builds.

Without Flink (the default suite: PyFlink never enters the test env): every workload's
Flink SQL writes its output with Kafka transactions committed by exactly-once checkpoints
under a run's own transactional ids, and the window matches the other peers'. With Flink
(``long``; fetches PyFlink 2.3 and the Kafka connector into ``~/.cache/onceflow`` on first
use, ~850 MB): Flink's planner plans each workload's job (``--explain``: no job runs, no
broker is reached), which catches SQL and connector options Flink refuses.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
WORKLOADS = ("sum", "copy", "window")


@pytest.fixture(scope="module")
def flink_peer() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        import flink_peer

        return flink_peer
    finally:
        sys.path.remove(str(BENCH))


def arguments(workload: str, work: Path) -> argparse.Namespace:
    return argparse.Namespace(
        workload=workload,
        bootstrap="127.0.0.1:9092",
        input="events-in",
        output="results-out",
        work=str(work),
        checkpoint_ms=None,
    )


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_output_commits_with_exactly_once_checkpoints(flink_peer, workload, tmp_path):
    job = flink_peer.job(arguments(workload, tmp_path), str(tmp_path / "connector.jar"))
    source, sink = job.tables
    assert "'topic' = 'events-in'" in source
    assert "'scan.startup.mode' = 'earliest-offset'" in source
    assert "'topic' = 'results-out'" in sink
    assert "'sink.delivery-guarantee' = 'exactly-once'" in sink
    assert "'sink.transactional-id-prefix' = 'peer-flink-" in sink
    assert job.insert.startswith("INSERT INTO output")
    assert job.settings["execution.checkpointing.mode"] == "EXACTLY_ONCE"
    every = f"{flink_peer.CHECKPOINT_MS} ms"
    assert job.settings["execution.checkpointing.interval"] == every
    assert job.settings["pipeline.jars"] == (tmp_path / "connector.jar").as_uri()


def test_each_run_writes_under_transactional_ids_of_its_own(flink_peer, tmp_path):
    """A run reusing another's ids would abort that run's open transactions when it starts."""
    first, second = (flink_peer.job(arguments("sum", tmp_path), "c.jar") for _ in range(2))
    assert first.tables[1] != second.tables[1]


def test_the_window_is_the_other_peers_window(flink_peer, tmp_path):
    """Sizes from bench/peer_jobs.py: 10 s every 2 s, 1 s of lateness."""
    job = flink_peer.job(arguments("window", tmp_path), "c.jar")
    assert flink_peer.interval(1500) == "INTERVAL '1.500' SECOND"
    step, size = flink_peer.interval(flink_peer.STEP_MS), flink_peer.interval(flink_peer.WINDOW_MS)
    assert f"HOP(TABLE events, DESCRIPTOR(event_time), {step}, {size})" in job.insert
    assert f"event_time - {flink_peer.interval(flink_peer.LATENESS_MS)}" in job.tables[0]
    assert "'scan.parallelism' = '1'" in job.tables[0], "one source task: no early watermark"


def test_the_checkpoint_interval_can_be_chosen(flink_peer, tmp_path):
    args = arguments("copy", tmp_path)
    args.checkpoint_ms = 2000
    assert flink_peer.job(args, "c.jar").settings["execution.checkpointing.interval"] == "2000 ms"


@pytest.mark.long
@pytest.mark.parametrize("workload", WORKLOADS)
def test_flink_plans_the_job(flink_peer, workload, tmp_path):
    python = flink_peer.flink_python()
    command = [python, str(BENCH / "peer_jobs.py"), "flink", workload, "--explain"]
    command += ["--bootstrap", "127.0.0.1:9", "--input", "in", "--output", "out"]
    command += ["--work", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    lines = (done.stdout + done.stderr).splitlines()
    causes = [x for x in lines if "Exception" in x and not x.lstrip().startswith("at ")]
    tail = "\n".join(causes[-3:] or lines[-12:])
    assert done.returncode == 0, tail
    assert "== Optimized Execution Plan ==" in done.stdout, tail
    assert "Sink(table=[default_catalog.default_database.output]" in done.stdout, tail
