"""PostgreSQL's changes read straight from a replication slot, exactly once across kill -9.

A 5,000-row table is snapshotted by a run killed -9 (every process) at a random moment soon
after it starts (mostly mid-snapshot: the next run takes a new snapshot on a new slot); a
second run streams while inserts, updates and deletes of the same keys follow in quick
succession in small transactions and one large transaction inserts then updates 3,000 rows
(100,000 with ``--long``, which also kills the Kafka broker -9 and starts it again meanwhile;
another long variant crashes Redis's host instead),
and is killed -9 at a random moment mid-stream; a third run reads
to the end. 100 row changes are made while the pipeline is down after its first run. The copy
must equal the source table; the output must hold one record per row change made (counted by
the statements' row counts, not by the pipeline) and the snapshot's rows, each ID once.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import Counter

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.connectors.postgres_changes import slot_name
from onceflow.kernel import ids
from onceflow.testing.harness import KillAfter, run_pipeline
from tests.exactly_once.cdc_workload import Workload, create_tables, read_both

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]

PIPELINE = __file__.rsplit("/", 2)[0] + "/e2e_pipelines/pg_changes.py"
ROWS = 5000
DOWN = 100  # row changes made while the pipeline is down, after its first run


@pytest.mark.parametrize(
    ("large", "fault"),
    [
        pytest.param(3_000, None, id="3k"),
        pytest.param(100_000, "broker", id="100k-broker-restart", marks=pytest.mark.long),
        pytest.param(3_000, "redis-host", id="3k-redis-host-crash", marks=pytest.mark.long),
    ],
)
def test_a_table_copied_from_a_replication_slot_is_identical_across_kill_9(
    request, postgres_server, tmp_path, large, fault
):
    # the long variants also kill the Kafka broker (the sinks') -9 and start it again, or
    # crash Redis's host (everysec: the unsynced tail of its AOF lost), mid-stream
    broker = request.getfixturevalue("own_broker" if fault == "broker" else "broker")
    redis_server = request.getfixturevalue(
        "crashable_redis" if fault == "redis-host" else "redis_server"
    )
    rng = random.Random(large + 1)
    name = f"pgc-{uuid.uuid4().hex[:8]}"
    source, copy = f"src_{name[4:]}", f"dst_{name[4:]}"
    create_tables(postgres_server, source, copy, ROWS)
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        "CDC_PIPELINE": name,
        "PG_SOURCE": f"public.{source}",
        "CDC_OUT": f"{name}-out",
        "CDC_OPS": f"{name}-ops",
        "PG_TABLE": copy,
        **postgres_server.env,
    }
    args = ["--redis-url", redis_server.url, "--checkpoint", str(tmp_path / "ckpt")]
    args += ["--output-dir", str(tmp_path / "out")]
    streaming = [*args, "--trigger-seconds", "0"]

    cut = KillAfter("first micro-batch starts", rng.uniform(0.2, 2.5))
    first = run_pipeline(PIPELINE, streaming, env=env, kill_when=cut.when, echo=cut.echo)
    assert first.crashed, first.output[-3000:]

    workload = Workload(postgres_server, source, rng)
    workload.small(DOWN)  # while the pipeline is down, maybe mid-snapshot: in its slot's log

    def changes() -> None:
        workload.small(600)
        if fault == "broker":
            broker.kill()
            time.sleep(3.0)
            broker.start()
        elif fault == "redis-host":
            redis_server.crash_host()
        workload.large(large)
        workload.small(600)
        workload.end()

    writer = threading.Thread(target=changes)
    cut = KillAfter("] batch ", rng.uniform(2.0, 6.0))

    def start_writing(line: str) -> None:  # once the run's slot exists: its snapshot is read
        if "] batch " in line and writer.ident is None:
            writer.start()
        cut.echo(line)

    second = run_pipeline(PIPELINE, streaming, env=env, kill_when=cut.when, echo=start_writing)
    assert second.crashed, second.output[-3000:]
    writer.join(600)
    ran = run_pipeline(PIPELINE, [*args, "--available-now"], env=env, timeout=900)
    assert ran.returncode == 0, ran.output[-3000:]

    want, got = read_both(postgres_server, source, copy)
    assert got == want, f"the copy differs from the source table: {ran.output[-3000:]}"
    settings = KafkaSettings(broker.bootstrap)
    written: Counter[bytes] = Counter()
    ops: Counter[str] = Counter()
    for record in read_topic(settings, f"{name}-ops"):
        written[dict(record.headers)[ids.ID_HEADER]] += 1
        ops[json.loads(record.value)["op"]] += 1
    assert max(written.values()) == 1, "a change written twice"
    streamed = sum(n for op, n in ops.items() if op != "read")
    assert streamed == workload.changed, f"{streamed} changes read, {workload.changed} made"
    # the snapshot: every row once; if the first run died mid-snapshot and the next took a new
    # one, the rows the changes made while it was down touched are read in their new state
    # (again, if the first attempt's read was delivered), and a row deleted meanwhile is not
    # read unless the first attempt's read was delivered (its delete is streamed either way)
    assert ROWS - DOWN <= ops["read"] <= ROWS + DOWN, ops
    with postgres_server.connect() as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot_name(name),))
