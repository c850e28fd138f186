"""Large records (the issue's "Large records" finding): documents of 100 KB to 1 MB.

A tester sent 2,200 JSON documents of 250 KB on one partition through a map to a Kafka sink:
the run stopped with "ConnectionError: Error 104 while writing to socket", 0 outputs, and
every rerun stalled the same way. Chunks were cut by count alone (2,500 inputs), so the one
chunk's commit carried ~550 MB of backup in one Lua argument: more than Redis takes
(``proto-max-bulk-len``, 512 MB by default). These tests run the same pipeline
(``tests/e2e_pipelines/totals.py``: enrich is the map, copy the Kafka sink) at CI scale, a
few hundred documents, against a Redis whose argument limit is scaled down with them (16 MB
instead of 512: the code before byte budgets sent all of them in one commit, which such a
Redis refuses, as the full-size one refused the tester's), and check the outcome with the
independent count of ``real_input.verify``. They also read every backup field Redis holds:
none may be larger than one chunk's bytes and one record.
"""

from __future__ import annotations

import pytest
import redis

from onceflow.kernel.keyspace import Keyspace, Kind
from onceflow.kernel.limits import CHUNK_BYTES, RECORD_BYTES
from onceflow.testing.harness import Crash, run_pipeline
from tests.exactly_once.real_input import PIPELINE, Send, event, new_run, stats, verify

pytestmark = [pytest.mark.kafka, pytest.mark.redis]
REDIS_ARGUMENT_LIMIT = 16 << 20  # Redis's 512 MB, scaled down with the data
KB = 1000


def _tight_redis(redis_factory, limit: int = REDIS_ARGUMENT_LIMIT):
    """A Redis that refuses one argument over ``limit`` (as a default one does over 512 MB)."""
    server = redis_factory()
    redis.Redis(port=server.port).config_set("proto-max-bulk-len", limit)
    return server


def _document(i: int, smallest: int = 250 * KB, spread: int = 700 * KB) -> str:
    """A document body of ``smallest`` to ``smallest + spread`` bytes (JSON text)."""
    return f"{i:08d}" * ((smallest + (i * 7919) % spread) // 8)


def _largest_backup_field(server, name: str) -> int:
    """The longest value of any field of any backup hash of the namespace."""
    client = redis.Redis(port=server.port)
    ks = Keyspace(name)
    largest = 0
    for key in client.scan_iter(match=ks.pattern(), count=1000):
        parsed = ks.parse(key)
        if parsed is None or parsed.kind is not Kind.BACKUP:
            continue
        for field in client.hkeys(key):
            largest = max(largest, client.hstrlen(key, field))
    return largest


@pytest.mark.long  # CI time (~11 s): the kill between byte-bounded chunks below carries
# large documents too, as does the fault-matrix torture (1 MB)
def test_hundreds_of_large_documents_on_one_partition_reach_the_sink_once(
    broker, redis_factory, tmp_path
):
    """The tester's scenario at CI scale: 200 documents of 250-950 KB (~120 MB) on one
    partition, one micro-batch, one task: the run finishes and every copy is there once."""
    server = _tight_redis(redis_factory)
    run = new_run(broker, server.url, tmp_path, partitions=1)
    docs = 200
    run.produce([Send(event(run, f"u{i % 5}", i % 7 + 1, body=_document(i))) for i in range(docs)])
    run_pipeline(PIPELINE, run.args(), env=run.env).check()
    facts = verify(run, redis.Redis(port=server.port))
    assert facts["copy_ids"] == docs
    assert _largest_backup_field(server, run.name) <= CHUNK_BYTES + RECORD_BYTES


CRASHES = [
    # after the first chunk's commit: the rerun replays it from the backup, commits the rest
    Crash("after_commit", stage="events", batch=0, partition=0),
    # the first delivery committed in Kafka, not yet logged: the rerun finds it pending (CI
    # time: test_crashes.py runs this point by default, with records of every size)
    pytest.param(
        Crash("after_sink_commit", stage="events", batch=0, partition=0), marks=pytest.mark.long
    ),
]


@pytest.mark.parametrize("crash", CRASHES, ids=lambda c: getattr(c, "point", None))
def test_a_kill_between_byte_bounded_chunks_or_deliveries_is_exact(
    crash, broker, redis_factory, tmp_path
):
    """60 documents of 100-400 KB (~15 MB), commits of 1 MiB and deliveries of 2 MiB: the
    kill -9 of every process lands after the first of many, the rerun is exact."""
    server = _tight_redis(redis_factory, 8 << 20)
    env = {"TOTALS_CHUNK_BYTES": str(1 << 20), "TOTALS_DELIVERY_BYTES": str(2 << 20)}
    env["TOTALS_PARQUET"] = str(tmp_path / "lake")  # the documents as Parquet too (pyarrow)
    run = new_run(broker, server.url, tmp_path, partitions=1, **env)
    docs = 60
    bodies = [_document(i, 100 * KB, 300 * KB) for i in range(docs)]
    run.produce([Send(event(run, f"u{i % 3}", 1, body=bodies[i])) for i in range(docs)])
    first = run_pipeline(PIPELINE, run.args(), env=run.env, crash=crash)
    assert first.crashed, first.output[-3000:]
    client = redis.Redis(port=server.port)
    backup = client.hkeys(Keyspace(run.name).backup("events", 0, 0))
    chunks = [f for f in backup if f.startswith(b"c")]
    assert chunks and b"done" not in backup, f"the kill landed inside the task: {backup}"
    run_pipeline(PIPELINE, run.args(), env=run.env).check()
    facts = verify(run, client)
    assert facts["copy_ids"] == docs and facts["parquet_rows"] == docs
    assert _largest_backup_field(server, run.name) <= (1 << 20) + RECORD_BYTES


def test_a_record_over_the_limit_is_one_dead_letter_and_the_rest_is_delivered(
    broker, redis_factory, tmp_path
):
    """max_record_bytes 200 KB: a 300 KB input is never processed, a 50 KB input the map
    pads by 300 KB keeps its total but its copy is a dead letter; each letter says why."""
    server = _tight_redis(redis_factory)
    run = new_run(broker, server.url, tmp_path, partitions=1, TOTALS_MAX_RECORD_BYTES="200000")
    sends = [
        Send(event(run, f"u{i % 3}", 1, body=_document(i, 100 * KB, 80 * KB))) for i in range(30)
    ]
    big = event(run, "u1", 5, body=_document(0, 300 * KB, 1))
    run.expected["u1"] -= 5  # never processed
    del run.events[big["event_id"]]
    grown = event(run, "u2", 7, body=_document(1, 50 * KB, 1), pad=300_000)
    del run.events[grown["event_id"]]  # counted in its total, its copy is a dead letter
    sends[10:10] = [Send(big), Send(grown)]
    run.poison = {big["event_id"]: "max_record_bytes", grown["event_id"]: "max_record_bytes"}
    run.produce(sends)
    run_pipeline(PIPELINE, run.args(), env=run.env).check()
    facts = verify(run, redis.Redis(port=server.port))
    assert facts["dead_letters"] == 2 and facts["copy_ids"] == 30
    assert stats(redis.Redis(port=server.port), run)["too_large"] == 1, "the input, counted"


@pytest.mark.long
def test_the_testers_scenario_at_full_size(broker, redis_factory, tmp_path):
    """2,200 documents of 250 KB (550 MB) on one partition, a Redis with its default limits:
    what stopped after 122 s with 0 outputs, and stalled on every rerun, runs through."""
    server = redis_factory()
    run = new_run(broker, server.url, tmp_path, partitions=1)
    docs = 2200
    sends = [Send(event(run, f"u{i % 50}", 1, body=_document(i, 250 * KB, 1))) for i in range(docs)]
    run.produce(sends)
    run.cap = docs  # one micro-batch, as the tester's available-now run read it
    run_pipeline(PIPELINE, run.args(), env=run.env, timeout=1800).check()
    facts = verify(run, redis.Redis(port=server.port))
    assert facts["copy_ids"] == docs
    assert _largest_backup_field(server, run.name) <= CHUNK_BYTES + RECORD_BYTES
