"""The short torture run for CI: three random kill -9s of the whole run, messy input, one
final run, then the independent check (see ``torture.py``; run it longer with
``python -m tests.exactly_once.torture --minutes 10``).

The default suite runs it where the newest paths are: a Redis Cluster (``redis+cluster://``)
and the confluent-kafka client; the classic set-up (one Redis, kafka-python), which the rest of
the crash suite exercises point by point, runs it with ``--long``. Input without IDs (a
record's ID is its offset: the path that skips Bloom filters and seen-marks) runs on one
Redis with kafka-python with ``--long`` too (``test_crashes.py`` kills it point by point by
default).

The Redis host-crash torture (``redis-host-crash``) runs a Redis 8 with ``appendfsync
everysec`` whose host crashes twice in each attempt, at random moments while the pipeline
runs: it loses what it had not fsynced (``onceflow.testing.hostcrash``), comes back on the
same files, and the run must carry on from what it kept; each attempt is also killed -9.
Its long variant (``--long``) runs five kills over bigger waves; ``python -m
tests.exactly_once.torture --redis-host-crash --minutes 30`` keeps going for as long as asked.

With ``--long`` too: a process stage with state and timers that rejects events by their
content, in its element function and in its timer, under random kills (its dead letters
exactly those events, once each, its outputs and state exactly those of the others); and
documents of 0.5-0.95 MB through that stage's state under random kills.
"""

from __future__ import annotations

import pytest

from onceflow.kernel.settings import RedisSettings, redis_client
from tests.exactly_once.real_input import sinks_env
from tests.exactly_once.replays import REPLAYABLE
from tests.exactly_once.torture import check, torture

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]


@pytest.mark.parametrize(
    ("seed", "kills", "wave", "restarts", "process"),
    [
        # seed 61: one event days ahead, one that enrich fails on (its letter replayed)
        pytest.param(61, 0, 800, False, False, id="short"),
        pytest.param(67, 3, 1500, True, True, id="long", marks=pytest.mark.long),
    ],
)
def test_every_sink_under_the_fault_matrix_and_a_dead_letter_replay_is_exact(
    broker,
    crashable_redis,
    postgres_server,
    tmp_path,
    request,
    seed,
    kills,
    wave,
    restarts,
    process,
):
    """Every sink (Kafka, Parquet, JSON lines, PostgreSQL, Iceberg), each read back by a reader
    of its own, under the faults at once: IDs as bytes, text and body fields on 4 partitions,
    copies re-sent seconds and hours later (in event time, or in wall time only), an event
    days ahead, documents of up to 1 MB; in each attempt two crashes of Redis's host (Redis 8,
    ``everysec``), in ``kills`` of them then a kill -9 of every process of the run; then the
    dead letters' causes fixed and the letters replayed beside an attempt (killed -9 if it is
    still running at its kill time; a replay killed -9, two at once), and a last run; each run
    not killed must end by itself.
    ``restarts`` (``--long``): the broker killed -9 and restarted in every attempt too, and a
    process stage with state and timers."""
    kafka = request.getfixturevalue("own_broker") if restarts else None
    t = torture(
        kafka.bootstrap if kafka is not None else broker.bootstrap,
        crashable_redis.url,
        str(tmp_path),
        seed=seed,
        kills=kills,
        wave=wave,
        cap=400,
        min_kill_s=0.5,
        max_kill_s=2.5,
        redis_host=crashable_redis,
        broker=kafka,
        sinks_env=sinks_env(str(tmp_path), postgres=postgres_server.env),
        docs=0.01,
        process=process,
        replay=True,
        crash_always=True,
    )
    facts = check(t, redis_client(RedisSettings(crashable_redis.url), t.run.name))
    print(f"[torture] every sink, the fault matrix: {facts}")
    assert not t.stops, f"a run stopped by itself instead of riding a fault out: {t.stops}"
    # the kills asked for always land; the attempt beside the replay is killed only if it is
    # still running at its kill time (a quick machine may finish its 400 events first: seen
    # once in a local run), while a replay killed -9 always is (a replay that ends before its
    # kill time is followed by one killed sooner: seen once in CI)
    assert facts["kills"] >= kills, f"an attempt ended before it could be killed: {facts}"
    assert facts["replays_killed"] >= 1, facts
    assert facts["redis_crashes"] >= 4 and facts["redis_lost_bytes"] > 0, facts
    if restarts:
        assert facts["broker_restarts"] >= kills, f"the broker restarted too rarely: {facts}"
    for rows in ("parquet_rows", "jsonl_rows", "postgres_rows", "iceberg_rows"):
        assert facts[rows] == facts["copy_ids"], f"{rows}: {facts}"
    assert facts["documents"] >= 2, f"too few documents: {facts}"
    reasons = set(t.run.poison.values())
    assert "further ahead of the clock" in reasons, f"no days-ahead record: {reasons}"
    replayable = [m for m, r in t.run.poison.items() if r in REPLAYABLE]
    assert replayable, f"no dead letter to replay: {reasons}"
    # each replayed letter's event counted once is in check(); a replay killed -9 may have
    # sent some, all or none of its letters before it died, so only that all ran: the first
    # (and, when it ended before its kill time, those after it, until one was killed) and
    # the two at once
    assert facts["replays"] >= 3, facts


# CI time: the matrix round above crashes Redis's host by default; this one with --long
@pytest.mark.parametrize(
    ("seed", "kills", "wave"),
    [
        pytest.param(23, 2, 1200, marks=pytest.mark.long),
        pytest.param(41, 5, 3000, marks=pytest.mark.long, id="long"),
    ],
)
def test_redis_host_crashes_while_the_pipeline_runs_lose_and_duplicate_nothing(
    broker, crashable_redis, postgres_server, tmp_path, seed, kills, wave
):
    """Each attempt: two crashes of Redis's host, then a kill -9 of the run."""
    t = torture(
        broker.bootstrap,
        crashable_redis.url,
        str(tmp_path),
        seed=seed,
        kills=kills,
        wave=wave,
        cap=400,
        min_kill_s=0.5,
        max_kill_s=2.0,
        redis_host=crashable_redis,
        # a database sink too, read back by psycopg
        sinks_env=sinks_env(str(tmp_path), ("postgres",), postgres_server.env),
    )
    settings = RedisSettings(crashable_redis.url)
    facts = check(t, redis_client(settings, t.run.name))
    print(f"[torture] redis host crashes: {facts}")
    assert t.redis_crashes >= 3, f"Redis crashed too rarely: {facts}"
    assert not t.stops, f"a run stopped by itself instead of riding a crash out: {t.stops}"
    assert facts["redis_lost_bytes"] > 0, f"the crashes lost no acknowledged write: {facts}"
    assert t.reruns >= 1, f"no batch was run again after a crash: {facts}"
    assert facts["poison"] > 0 and facts["duplicates_dropped"] > 0
    assert facts["postgres_rows"] > 0


@pytest.mark.parametrize(
    "setup",
    [
        "redis-cluster+confluent",
        # CI time: position IDs across kills are checked point by point in test_crashes.py
        pytest.param("redis+kafka-python+positions", marks=pytest.mark.long),
        pytest.param("redis+kafka-python", marks=pytest.mark.long),
    ],
)
def test_random_kills_and_messy_input_lose_and_duplicate_nothing(setup, broker, request, tmp_path):
    if setup.startswith("redis-cluster+confluent"):
        cluster = request.getfixturevalue("redis_cluster")
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in cluster.ports)
        client = "confluent"
    else:
        url = request.getfixturevalue("redis_server").url
        client = "python"
    ids = "positions" if setup.endswith("+positions") else "mixed"
    # 4 micro-batches in the first run, 2-3 in the others: each outlasts its kill (<= 2 s after
    # its first new batch began), which lands among commits
    t = torture(
        broker.bootstrap,
        url,
        str(tmp_path),
        seed=11,
        kills=3,
        wave=1500,
        cap=400,
        max_kill_s=2.0,
        client=client,
        ids=ids,
        # read back by pyarrow and by plain file reads
        sinks_env=sinks_env(str(tmp_path), ("parquet", "jsonl")),
    )
    settings = RedisSettings(url)
    facts = check(t, redis_client(settings, t.run.name), lambda tag: redis_client(settings, tag))
    print(f"[torture] {setup}: {facts}")
    assert t.kills >= 2, f"the run ended before it could be killed: {facts}"
    assert t.in_flight >= 2, f"the kills cut no micro-batch short: {facts}"
    assert facts["poison"] > 0
    if ids == "mixed":
        assert facts["duplicates_dropped"] > 0
    else:  # every re-sent copy had to count again
        assert facts["copy_ids"] > len({e["event_id"] for e in t.sent})
    assert facts["parquet_rows"] > 0 and facts["jsonl_rows"] > 0
    reasons = set(t.run.poison.values())
    assert "further ahead of the clock" in reasons, "no days-ahead record in this seed's input"


@pytest.mark.long
@pytest.mark.parametrize(
    ("seed", "docs"), [pytest.param(47, 0.0, id="rejects"), pytest.param(53, 0.04, id="documents")]
)
def test_a_process_stage_rejecting_events_under_random_kills_is_exact(
    broker, redis_server, tmp_path, seed, docs
):
    """A process stage (state and timers) rejects events by content, in its element function
    and in its timer, both after changing state; with ``docs``, documents of 0.5-0.95 MB go
    through it and the largest-ID one per user is kept in its state."""
    t = torture(
        broker.bootstrap,
        redis_server.url,
        str(tmp_path),
        seed=seed,
        kills=3,
        wave=600 if docs else 1500,
        cap=100 if docs else 400,
        max_kill_s=2.0,
        process=True,
        docs=docs,
    )
    facts = check(t, redis_client(RedisSettings(redis_server.url), t.run.name))
    print(f"[torture] process stage, documents {docs}: {facts}")
    assert t.kills >= 2, f"the run ended before it could be killed: {facts}"
    assert t.in_flight >= 1, f"the kills cut no micro-batch short: {facts}"
    reasons = set(t.run.poison.values())
    assert {"rejected by per-user", "timer-rejected"} <= reasons, f"a kind is missing: {reasons}"
    if docs:
        assert facts["documents"] >= 20, f"too few documents: {facts}"
