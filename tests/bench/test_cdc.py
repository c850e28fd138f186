"""``bench/cdc.py`` at a tiny size: what it measures is what the database changed.

200 row changes (a snapshot, inserts, updates, deletes) go through Debezium, its topic is
copied as plain records, and each pipeline runs once in several micro-batches on the
session's Spark, Kafka, Redis and PostgreSQL. Every pipeline's output must hold one record
per change the statements made (the database's row counts, not the pipeline's), each ID
once, the same keys and values on both sides, and the printed table must say so. No timing
is checked: the numbers belong to the benchmark's output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings

pytestmark = [pytest.mark.spark, pytest.mark.kafka, pytest.mark.redis]

BENCH = Path(__file__).resolve().parents[2] / "bench"
CHANGES = 200


@pytest.fixture(scope="module")
def cdc() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        import cdc

        return cdc
    finally:
        sys.path.remove(str(BENCH))


# CI time: with --long (the CDC pipelines' exactness is tests/exactly_once/test_cdc.py's)
@pytest.mark.long
def test_every_pipeline_writes_one_record_per_row_change(
    cdc, spark, broker, redis_server, postgres_server, tmp_path
):
    args = argparse.Namespace(
        changes=CHANGES, repeat=1, tx_rows=50, converters="schemas", warmup=False
    )
    env = {
        "redis_url": redis_server.url,
        "bootstrap": broker.bootstrap,
        "settings": KafkaSettings(broker.bootstrap),
        "pg": postgres_server.server,
        "workdir": str(tmp_path),
        "batch": 100,  # several micro-batches: a steady state to measure
    }
    results = cdc.bench(spark, args, env)

    (capture,) = results.captures
    assert capture.changes == CHANGES, "the statements' row counts"
    assert capture.deletes > 0
    assert set(results.runs) == {"debezium/schemas", cdc.PLAIN}
    for kind, (run,) in results.runs.items():
        assert run["found"] == (CHANGES, CHANGES), f"{kind}: (records out, distinct IDs)"
        assert run["dead_letters"] == 0, kind
        assert run["steady"] > 0, f"{kind} ran in one micro-batch"
    digests = {run["digest"] for (run,) in results.runs.values()}
    assert len(digests) == 1, "the CDC and the plain pipeline wrote different keys or values"
    rows = [line for line in cdc.table(results) if line.startswith(("| debezium", "| plain"))]
    assert len(rows) == 2, rows
    assert all(row.endswith("| yes |") for row in rows), rows
