"""One pipeline reading another's Parquet files as a stream stays exactly once end to end.

Upstream: Kafka events (6% re-sent) -> a Parquet sink partitioned by user (its kill -9 tests
are in test_file_sink_crashes.py). Downstream: the folder watched
(``ParquetSource(watch=True)``), events counted per user into Kafka, killed -9 after its
source stage committed and resumed; then the upstream folder is compacted (the same rows in
new files) and the downstream run again. The counts read back from Kafka equal the distinct
events per user sent upstream: the rows' ``_onceflow_id`` column makes a compacted file's rows
copies, not new events.
"""

from __future__ import annotations

import glob
import json
import os
import re
import uuid

import pyarrow.parquet as pq
import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.operations.compaction import compact
from onceflow.sinks import Parquet
from onceflow.testing.harness import Crash, crash_and_resume, run_pipeline
from tests.exactly_once.scenario import make_scenario

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]

HERE = os.path.dirname(os.path.dirname(__file__))
UPSTREAM = os.path.join(HERE, "e2e_pipelines", "files_orders.py")
DOWNSTREAM = os.path.join(HERE, "e2e_pipelines", "parquet_chain.py")


def _counts(bootstrap: str, topic: str) -> dict[str, int]:
    latest = {}
    for record in read_topic(KafkaSettings(bootstrap), topic):
        latest[record.key.decode()] = json.loads(record.value)
    return latest


# CI time (~40 s): with --long. The default suite keeps its parts: Parquet rows keep the
# _onceflow_id a sink wrote (test_file_stream's decoder test), a watched folder under kill -9
# (test_file_stream), the Parquet sink under kill -9 (test_file_sink_crashes)
@pytest.mark.long
def test_a_pipeline_watching_another_s_parquet_files_counts_each_event_once(
    broker, redis_server, tmp_path
):
    scn = make_scenario(broker, redis_server.url, tmp_path, resent_percent=6)
    folder = os.path.join(str(tmp_path), "files")
    scn.extra_env.update(PARQUET_OUT=folder, FILES_FORMAT="parquet")
    upstream = run_pipeline(UPSTREAM, scn.args, env=scn.env)
    assert upstream.returncode == 0, upstream.output[-2000:]

    name = f"chain-{uuid.uuid4().hex[:8]}"
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        "CHAIN_PIPELINE": name,
        "CHAIN_IN": folder,
        "CHAIN_OUT": f"{name}-out",
        "CHAIN_FILES_PER_BATCH": "3",
    }
    args = ["--redis-url", redis_server.url, "--available-now"]
    args += ["--checkpoint", os.path.join(str(tmp_path), "chain-checkpoint")]
    args += ["--output-dir", os.path.join(str(tmp_path), "chain-out")]
    crash = Crash("after_commit", stage="files", batch=1)
    first, second = crash_and_resume(DOWNSTREAM, crash, args, env=env)
    assert first.crashed and second.returncode == 0, second.output[-2000:]
    assert _counts(broker.bootstrap, env["CHAIN_OUT"]) == dict(scn.expected)

    done = compact(redis_server.client(), scn.name, "files", Parquet(folder))
    assert done.written > 0, "nothing compacted: the copies below are not tested"
    ran = run_pipeline(DOWNSTREAM, args, env=env)
    assert ran.returncode == 0, ran.output[-2000:]
    dropped = [
        int(n.replace(",", "")) for n in re.findall(r"([\d,]+) duplicates dropped", ran.output)
    ]
    merged = glob.glob(os.path.join(folder, "**", "compacted-*.parquet"), recursive=True)
    rows = sum(pq.read_metadata(f).num_rows for f in merged)
    assert sum(dropped) == rows > 0, f"{rows} compacted rows, read as copies: {dropped}"
    assert _counts(broker.bootstrap, env["CHAIN_OUT"]) == dict(scn.expected), (
        "a compacted file's rows counted again"
    )
