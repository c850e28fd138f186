"""A pipeline file's helper modules reach executors on a cluster (not only the driver)."""

from __future__ import annotations

import json
import time

import pytest

from onceflow.testing.harness import run_pipeline
from tests.fixtures.spark_cluster import cluster_cli_args, driver_env

pytestmark = pytest.mark.cluster

HELPER = """
def shout(word):
    return word.upper() + "!"
"""

PIPELINE = """
import os

import shout_helper
from onceflow import Pipeline
from onceflow.pipeline import sinks, sources

pipeline = Pipeline("shipping")
pipeline.read("words", sources.Collection(["a", "b", "c", "d"])).map(
    "shout", shout_helper.shout
).write("out", sinks.JsonLines(os.environ["SHIPPING_OUT"], shared=True))
"""


def test_helper_modules_next_to_the_pipeline_file_are_shipped(standalone_cluster, tmp_path):
    started = time.monotonic()
    code = tmp_path / "code"
    code.mkdir()
    (code / "shout_helper.py").write_text(HELPER)
    (code / "shipping_pipeline.py").write_text(PIPELINE)
    out = tmp_path / "shared" / "out.jsonl"
    env = {
        **driver_env(),
        "SHIPPING_OUT": str(out),
        "ONCEFLOW_SHARED_DIRS": str(tmp_path / "shared"),  # the default dead letters go here
    }
    args = [
        *cluster_cli_args(standalone_cluster),
        "--output-dir",
        str(tmp_path / "shared" / "onceflow-output"),
        "--no-progress",
    ]
    outcome = run_pipeline(str(code / "shipping_pipeline.py"), args, env=env, timeout=240)
    outcome.check()
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(written) == ["A!", "B!", "C!", "D!"]
    took = time.monotonic() - started
    print(f"[cluster] shipping run {outcome.seconds:.1f} s, test {took:.1f} s")


def test_a_local_output_path_is_refused_on_a_cluster(standalone_cluster, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "shout_helper.py").write_text(HELPER)
    (code / "shipping_pipeline.py").write_text(PIPELINE.replace(", shared=True", ""))
    env = {**driver_env(), "SHIPPING_OUT": str(tmp_path / "out.jsonl")}
    args = [*cluster_cli_args(standalone_cluster), "--output-dir", str(tmp_path / "o")]
    outcome = run_pipeline(str(code / "shipping_pipeline.py"), args, env=env, timeout=240)
    assert outcome.returncode == 2, outcome.output[-2000:]
    assert "each worker's own disk" in outcome.output
