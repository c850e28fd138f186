"""Exactly-once under input as production sends it (the reliability issue, points 1-5, 8).

Each test feeds ``tests/e2e_pipelines/totals.py`` through a plain kafka-python producer and
checks the outcome against an independent count (``real_input.verify``): keyed state, each
user's last total, one copy per event, and exactly the expected dead letters with reasons.
Each scenario failed on the landed code before its fix (see the closing note of the issue).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid

import pytest

from onceflow.kernel.keyspace import Keyspace
from onceflow.testing.harness import run_pipeline
from tests.exactly_once.real_input import (
    PIPELINE,
    Send,
    event,
    new_run,
    stats,
    verify,
)

pytestmark = [pytest.mark.kafka, pytest.mark.redis]
HOUR = 3_600_000


def _now() -> int:
    return int(time.time() * 1000)


def test_ids_in_headers_as_text_or_bytes_and_an_empty_one(broker, redis_server, tmp_path):
    """Point 1: a text ID header must not halt the pipeline; text and bytes of one UUID agree."""
    run = new_run(broker, redis_server.url, tmp_path)
    rng = random.Random(1)
    sends = []
    for i in range(600):
        e = event(run, f"u{i % 7}", rng.randrange(1, 9))
        uid = uuid.UUID(e["event_id"])
        if i % 3 == 0:  # a UUID as text (36 bytes) ...
            sends.append(Send(e, i % 2, [("onceflow-id", str(uid).encode())]))
            if i % 12 == 0:  # ... re-sent by another producer as its 16 bytes: a copy
                sends.append(Send(e, (i + 1) % 2, [("onceflow-id", uid.bytes)]))
        elif i % 3 == 1:  # a business key as text
            sends.append(Send(e, i % 2, [("onceflow-id", f"order-{e['event_id']}".encode())]))
        else:
            sends.append(Send(e, i % 2, [("onceflow-id", uid.bytes)]))
    bad = {"event_id": "empty-header", "user": "u0", "amount": 1000}
    sends.insert(300, Send(bad, 0, [("onceflow-id", b"")]))
    run.poison["empty-header"] = "header is empty"
    run.produce(sends)
    outcome = run_pipeline(PIPELINE, run.args(), env=run.env).check()
    assert outcome.returncode == 0
    verify(run, redis_server.client())
    assert stats(redis_server.client(), run)["duplicates"] == 50


def _batches(run, log: str) -> list[str]:
    """The micro-batch files of a checkpoint log (not the file system's ``.crc`` files)."""
    names = os.listdir(os.path.join(run.workdir, "checkpoint", log))
    return sorted(n for n in names if n.isdigit())


@pytest.mark.parametrize(
    "partitions",
    [pytest.param(1, marks=pytest.mark.long), pytest.param(4, marks=pytest.mark.long), 12],
)
def test_available_now_stops_at_the_high_water_mark_fresh_and_after_a_restart(
    partitions, broker, redis_server, tmp_path
):
    """Point 2: offsets are canonical, no empty micro-batch runs, the run ends."""
    run = new_run(broker, redis_server.url, tmp_path, partitions=partitions)
    run.cap = 700
    sends = [Send(event(run, f"u{i % 5}", 1), i % partitions) for i in range(2000)]
    run.produce(sends)
    first = run_pipeline(PIPELINE, run.args(), env=run.env, timeout=300).check()
    commits = _batches(run, "commits")
    offsets = _batches(run, "offsets")
    assert len(offsets) == len(commits) == 3, f"2000 records, 700 a batch: {sorted(offsets)}"
    again = run_pipeline(PIPELINE, run.args(), env=run.env, timeout=300).check()
    assert len(_batches(run, "offsets")) == 3, "a restart with nothing new must not plan a batch"
    more = [Send(event(run, "u9", 2), i % partitions) for i in range(300)]
    run.produce(more)
    third = run_pipeline(PIPELINE, run.args(), env=run.env, timeout=300).check()
    assert len(_batches(run, "commits")) == 4
    verify(run, redis_server.client())
    assert first.returncode == again.returncode == third.returncode == 0


@pytest.mark.long  # CI time (~18 s): the default fault-matrix torture re-sends copies hours
# later, in event time and in wall time only (tests/exactly_once/test_torture.py)
def test_copies_re_sent_hours_later_with_new_kafka_timestamps_are_dropped(
    broker, redis_server, tmp_path
):
    """Point 3: event time from the Kafka timestamp; 390 copies re-sent 2 h later."""
    run = new_run(broker, redis_server.url, tmp_path)
    rng = random.Random(3)
    base = _now() - 3 * HOUR
    events = [event(run, f"u{rng.randrange(100)}", rng.randrange(1, 9)) for _ in range(4000)]
    sends = [
        Send(e, i % 2, [("onceflow-id", uuid.UUID(e["event_id"]).bytes)], base + i)
        for i, e in enumerate(events)
    ]
    resent = rng.sample(events, 390)
    sends += [
        Send(
            e, rng.randrange(2), [("onceflow-id", uuid.UUID(e["event_id"]).bytes)], base + 2 * HOUR
        )
        for e in resent
    ]
    run.produce(sends)
    run_pipeline(PIPELINE, run.args(), env=run.env).check()
    verify(run, redis_server.client())
    assert stats(redis_server.client(), run)["duplicates"] == 390


def test_one_event_from_a_wrong_clock_goes_to_dead_letters_and_moves_nothing(
    broker, redis_server, tmp_path
):
    """Point 4: one event 3 days ahead in the middle of 6,000 at the current time."""
    run = new_run(broker, redis_server.url, tmp_path, TOTALS_ID_FIELD="1", TOTALS_TS_FIELD="1")
    rng = random.Random(4)
    now = _now()
    sends = []
    for i in range(6000):
        e = event(run, f"u{rng.randrange(100)}", 1, ts=now - 60_000 + i)
        sends.append(Send(e, i % 2))
        if i == 3000:
            ahead = {
                "event_id": "from-the-future",
                "user": "u1",
                "amount": 1,
                "ts": now + 3 * 24 * HOUR,
            }
            sends.append(Send(ahead, 0))
            seconds = {"event_id": "in-seconds", "user": "u2", "amount": 1, "ts": now // 1000}
            sends.append(Send(seconds, 1))
    run.poison["from-the-future"] = "further ahead of the clock"
    run.poison["in-seconds"] = "looks like seconds"
    run.produce(sends)
    run_pipeline(PIPELINE, run.args(), env=run.env).check()
    verify(run, redis_server.client())
    wm = int(redis_server.client().hget(Keyspace(run.name).clock, "watermark"))
    assert wm <= _now(), "the watermark went past the clock"


def test_a_failed_run_reads_as_one_short_error(broker, redis_server, tmp_path):
    """Point 5: the exception, the stage, the record's origin and where the full log is."""
    run = new_run(broker, redis_server.url, tmp_path, TOTALS_ON_ERROR="fail")
    sends = [Send(event(run, "u1", 1), 0) for _ in range(50)]
    sends.insert(20, Send({"event_id": "boom", "user": "u1", "amount": 1, "blow_up": True}, 0))
    run.produce(sends)
    outcome = run_pipeline(PIPELINE, run.args(), env=run.env)
    assert outcome.returncode == 1
    lines = [line for line in outcome.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, outcome.output[-3000:]
    assert lines == errors, f"{len(lines)} lines of output:\n{outcome.output[-3000:]}"
    line = errors[0]
    for part in ("stage 'events'", "ValueError", "asked to blow up", f"{run.topics['in']}:0@20"):
        assert part in line, f"{part!r} not in {line!r}"
    log = line.rsplit("full log: ", 1)[1].rstrip(")")
    with open(log, encoding="utf-8") as fh:
        assert "Traceback" in fh.read(), "the full log holds the worker's traceback"


def test_a_record_too_big_for_the_sink_goes_to_dead_letters(broker, redis_server, tmp_path):
    """Point 1 (sinks): a poison sink record must not fail every retry."""
    run = new_run(broker, redis_server.url, tmp_path, TOTALS_COPY_MAX_BYTES="20000")
    sends = [Send(event(run, f"u{i % 3}", 1), i % 2) for i in range(300)]
    big = event(run, "u1", 5, pad=50_000)
    del run.events[big["event_id"]]  # its copy cannot be written: it is a dead letter
    sends.insert(150, Send(big, 1))
    run.poison[big["event_id"]] = "max_request_size"
    run.produce(sends)
    run_pipeline(PIPELINE, run.args(), env=run.env).check()
    verify(run, redis_server.client())


@pytest.mark.long  # a related refusal runs by default: tests/runtime/test_checkpoint_location.py
def test_a_fresh_checkpoint_over_an_old_namespace_is_refused_until_reset(
    broker, redis_server, tmp_path
):
    """Point 8: a new checkpoint would re-read input the namespace already backed up."""
    run = new_run(broker, redis_server.url, tmp_path)
    run.produce([Send(event(run, "u1", 1), i % 2) for i in range(100)])
    run_pipeline(PIPELINE, run.args(), env=run.env).check()
    refused = run_pipeline(PIPELINE, run.args("other-checkpoint"), env=run.env)
    assert refused.returncode == 2 and "onceflow reset --namespace" in refused.output
    gone = os.path.join(run.workdir, "checkpoint")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "onceflow",
            "reset",
            "--namespace",
            run.name,
            "--checkpoint",
            gone,
            "--redis-url",
            redis_server.url,
            "--yes",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(gone)
    assert not redis_server.client().exists(Keyspace(run.name).meta)
    again = run_pipeline(PIPELINE, run.args(), env=run.env).check()
    assert again.returncode == 0
    verify(run, redis_server.client())


def test_one_id_header_copied_onto_other_records_makes_dead_letters_not_drops(
    broker, redis_server, tmp_path
):
    """An app between two pipelines (a Kafka Streams app, a Connect SMT) copied one record's
    onceflow-id header onto three other records: they are no copies (other bytes), so each
    is an id_conflict dead letter, while a true re-send of a record is dropped as a copy."""
    run = new_run(broker, redis_server.url, tmp_path)
    run.cap = 100  # the copies come in later micro-batches than the record they copy
    rng = random.Random(9)
    sends, headers = [], []
    for i in range(300):  # one partition: the original is read before its copies
        e = event(run, f"u{i % 7}", rng.randrange(1, 9))
        headers.append([("onceflow-id", uuid.UUID(e["event_id"]).bytes)])
        sends.append(Send(e, 0, headers[-1]))
    sends.append(Send(sends[7].value, 0, headers[7]))  # a re-send: the same bytes
    for n in range(3):
        marker = f"smt-copied-{n}"
        run.poison[marker] = "already used by a record with other content"
        body = {"event_id": marker, "user": "u0", "amount": 1000}
        sends.insert(50 + 80 * n, Send(body, 0, headers[5]))
    run.produce(sends)
    run_pipeline(PIPELINE, run.args(), env=run.env).check()
    verify(run, redis_server.client())  # the three letters, each with its reason
    assert stats(redis_server.client(), run)["duplicates"] == 1
