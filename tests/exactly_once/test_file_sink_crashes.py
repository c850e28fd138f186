"""The Parquet, JSON-lines, PostgreSQL and Iceberg sinks after kill -9 of every process.

The run is killed inside a sink transaction (files staged), after the delivery is recorded
as pending (staged, not renamed), after the rename (visible, not yet marked delivered) and
after the micro-batch's sinks but before Spark's commit; then run again. A reader that knows
nothing of Onceflow (pyarrow's dataset, a psycopg query, pyiceberg's scan) must see every event
exactly once.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pyarrow.dataset as ds
import pytest

from onceflow.kernel.keyspace import STAGING_FIELD, Keyspace
from onceflow.testing.harness import Crash, crash_and_resume
from tests.exactly_once.scenario import make_scenario

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]

PIPELINE = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "e2e_pipelines", "files_orders.py"
)
KILLS = [
    # staged and recorded as pending, not renamed: the default suite's point (the others are
    # played step by step, in one process, by tests/connectors/test_parquet.py)
    Crash("after_sink_write", stage="events", batch=1, partition=1),
    pytest.param(Crash("in_sink_transaction", stage="events", batch=1), marks=pytest.mark.long),
    pytest.param(Crash("after_sink_commit", stage="events", batch=1), marks=pytest.mark.long),
    pytest.param(Crash("batch_end", batch=1), marks=pytest.mark.long),
]


def _read_files(out: str, fmt: str, postgres=None) -> list[dict]:
    if fmt == "iceberg":
        from pyiceberg.catalog import load_catalog

        catalog = load_catalog(  # the pipeline's catalog (files_orders.py), opened anew
            "default",  # a SQL catalog keeps its tables under its name
            type="sql",
            uri=f"sqlite:///{os.path.join(out, 'catalog.db')}",
            warehouse=f"file://{os.path.join(out, 'warehouse')}",
        )
        table = catalog.load_table("onceflow.orders")
        return table.scan(selected_fields=("event_id", "user")).to_arrow().to_pylist()
    if fmt == "postgres":
        with postgres.connect() as conn:
            cur = conn.execute(f'SELECT event_id, "user" FROM {out}')
            return [{"event_id": e, "user": u} for e, u in cur.fetchall()]
    if fmt == "parquet":
        return ds.dataset(out, format="parquet", partitioning="hive").to_table().to_pylist()
    rows = []
    for name in sorted(os.listdir(out)):
        if name.startswith("part-"):
            with open(os.path.join(out, name), encoding="utf-8") as fh:
                rows += [json.loads(line)["value"] for line in fh if line.strip()]
    return rows


# CI time: PostgreSQL's protocol runs step by step against a real server in
# tests/connectors/test_postgres.py; its kill -9 runs here with --long, as JSON lines' does.
FORMATS = [
    "parquet",
    pytest.param("postgres", marks=pytest.mark.long),
    pytest.param("jsonl", marks=pytest.mark.long),
    pytest.param("iceberg", marks=pytest.mark.long),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("crash", KILLS, ids=lambda c: c.env())
def test_kill_9_at_each_delivery_point_leaves_every_event_once(
    crash, fmt, broker, redis_server, tmp_path, request
):
    scn = make_scenario(broker, redis_server.url, tmp_path, resent_percent=6)
    out = os.path.join(str(tmp_path), "files")
    scn.extra_env.update(PARQUET_OUT=out, FILES_FORMAT=fmt)
    postgres = None
    if fmt == "postgres":
        postgres = request.getfixturevalue("postgres_server")
        out = f"t_{scn.name.replace('-', '_')}"
        with postgres.connect() as conn:
            conn.execute(
                f'CREATE TABLE {out} (event_id text, "user" text, ts bigint, noise float8)'
            )
        scn.extra_env.update(PG_TABLE=out, **postgres.env)
    first, second = crash_and_resume(PIPELINE, crash, scn.args, env=scn.env)
    assert first.crashed and second.returncode == 0, second.output[-2000:]
    rows = _read_files(out, fmt, postgres)
    ids = Counter(r["event_id"] for r in rows)
    assert set(ids) == scn.unique_ids, "an event is missing"
    assert max(ids.values()) == 1, f"{sum(ids.values()) - len(ids)} events written twice"
    users = Counter(r["user"] for r in rows)
    assert users == scn.expected, "an event is in the wrong user's folder"
    left = [f for _d, _s, fs in os.walk(os.path.join(str(out), "_onceflow_staging")) for f in fs]
    assert left == [], f"staged files left behind: {left}"
    if fmt not in ("postgres", "iceberg"):  # a file sink lists its staging folder for gc
        listed = redis_server.client().hget(Keyspace(scn.name).meta, STAGING_FIELD)
        assert os.path.join(out, "_onceflow_staging") in json.loads(listed)
