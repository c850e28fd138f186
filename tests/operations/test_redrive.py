"""``onceflow dead-letters replay``: dead letters back through the pipeline once fixed, once.

A pipeline reads events, copies each to a topic (a sibling of the failing code) and sums them
per user. Some events make user code fail and some have no event time: they become dead
letters. Once "fixed", the letters are replayed (twice, as a replay killed before it saved its
progress and run again sends them): every sum ends right and the copy holds each event once
(the events user code failed on were copied the first time and must not be copied again).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.sink import CODE_HEADER
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.kernel.keyspace import Keyspace
from onceflow.operations.redrive import replay
from onceflow.pipeline import Pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.spark]

T0 = int(time.time() * 1000) - 3_600_000  # an hour ago: not "ahead" of the clock
EVENTS = 60


def _event(i: int) -> dict:
    event = {"user": f"u{i % 3}", "n": i, "t": T0 + i}
    if i % 20 == 7:
        del event["t"]  # no event time: the source's timestamp function fails on it
    return event


def _build(name, src, copy, totals, bootstrap, fixed):
    def event_time(e):
        return e["t"] if "t" in e or not fixed["on"] else T0

    def enrich(e):
        if e["n"] % 10 == 3 and not fixed["on"]:
            raise ValueError(f"cannot enrich event {e['n']}")
        return {**e, "weight": 2}

    p = Pipeline(name)
    read = p.read("events", KafkaSource(src, bootstrap_servers=bootstrap, timestamp=event_time))
    read.write("copy", KafkaSink(copy, bootstrap_servers=bootstrap))
    read.map("enrich", enrich).key_by("by-user", lambda e: e["user"]).map_values(
        "w", lambda e: e["n"] * e["weight"]
    ).combine_per_key("total", "sum").write(
        "totals", KafkaSink(totals, bootstrap_servers=bootstrap)
    )
    return p


def _run(p, spark, redis_server, tmp_path):
    return p.run(
        session=spark,
        redis_url=redis_server.url,
        available_now=True,
        checkpoint=os.path.join(tmp_path, "ckpt"),
        output_dir=str(tmp_path),
        progress=False,
    )


def test_replayed_dead_letters_reach_every_result_once(
    spark, broker, redis_server, tmp_path, topic_name
):
    settings = KafkaSettings(broker.bootstrap)
    src, copy, totals = topic_name("src"), topic_name("copy"), topic_name("totals")
    events = [_event(i) for i in range(EVENTS)]
    produce(
        settings,
        src,
        [(f"k{i}".encode(), json.dumps(e).encode(), None) for i, e in enumerate(events)],
    )
    fixed = {"on": False}
    p = _build(topic_name("redrive"), src, copy, totals, broker.bootstrap, fixed)
    client = redis_server.client()

    def copied() -> list[int]:
        return sorted(json.loads(r.value)["n"] for r in read_topic(settings, copy))

    def summed() -> dict[bytes, int]:
        latest: dict[bytes, int] = {}
        for r in read_topic(settings, totals):
            latest[r.key] = json.loads(r.value)
        return latest

    def expected(ns: list[int]) -> dict[bytes, int]:
        out: dict[bytes, int] = {}
        for n in ns:
            key = f"u{n % 3}".encode()
            out[key] = out.get(key, 0) + 2 * n
        return out

    no_time = [i for i in range(EVENTS) if i % 20 == 7]
    failing = [i for i in range(EVENTS) if i % 10 == 3]
    _run(p, spark, redis_server, tmp_path)
    dead = read_topic(settings, f"{p.name}.dead-letters")
    codes = sorted(r.headers[CODE_HEADER] for r in dead)
    assert codes == [b"no_time"] * len(no_time) + [b"user_error"] * len(failing)
    assert copied() == sorted(set(range(EVENTS)) - set(no_time))
    assert summed() == expected([i for i in range(EVENTS) if i not in no_time + failing])

    fixed["on"] = True
    found = replay(p, p.plan(), client)
    assert len(found.sends) == len(no_time) + len(failing) and not found.skipped
    assert replay(p, p.plan(), client).sends == [], "a second replay sends nothing new"
    # A replay killed after Kafka took its records, before it saved how far it got, sends the
    # same records again when rerun: the pipeline must drop the second copies.
    client.delete(Keyspace(p.name).redrive)
    assert len(replay(p, p.plan(), client).sends) == len(no_time) + len(failing)
    _run(p, spark, redis_server, tmp_path)
    assert copied() == list(range(EVENTS)), "each event copied once, failed ones not again"
    assert summed() == expected(list(range(EVENTS)))
    assert len(read_topic(settings, f"{p.name}.dead-letters")) == len(dead), "no new letters"


def test_the_command_says_what_it_would_replay_and_what_it_leaves(redis_server, tmp_path):
    """A pipeline without a Kafka dead-letter topic gets a one-line reason, not a trace."""
    pipeline_file = tmp_path / "files.py"
    pipeline_file.write_text(
        "from onceflow.pipeline import Pipeline\n"
        "from onceflow.connectors import JsonLinesSource, JsonLinesSink\n"
        "p = Pipeline('filesonly')\n"
        "p.read('in', JsonLinesSource('in.jsonl')).write('out', JsonLinesSink('out'))\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "onceflow",
            "dead-letters",
            "replay",
            str(pipeline_file),
            "--redis-url",
            redis_server.url,
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "has no dead-letter topic" in done.stderr and "Traceback" not in done.stderr


def _letter(offset, code, stage, origin, value=b"x", truncated=False, with_id=True):
    from onceflow.connectors.kafka.sink import ORIGIN_HEADER, STAGE_HEADER
    from onceflow.connectors.kafka.topics import TopicRecord
    from onceflow.kernel import ids

    headers = {CODE_HEADER: code.encode(), STAGE_HEADER: stage.encode()}
    headers[ORIGIN_HEADER] = origin.encode()
    if with_id:
        headers[ids.ID_HEADER] = offset.to_bytes(16, "big")
    if truncated:
        headers["onceflow-truncated"] = b"99999"
    return TopicRecord(0, offset, 0, None, value, headers)


def test_only_letters_that_can_go_back_whole_are_replayed():
    from onceflow.kernel import ids
    from onceflow.operations.redrive import plan_replay

    p = _build("sorting", "src", "copy", "totals", "localhost:9", {"on": True})
    json_letter = json.dumps({"value": '{"n": 3}', "value_json": True, "ts": T0}).encode()
    printed = json.dumps({"value": "<object at 0x1>", "ts": T0}).encode()
    read_at = "src:1@40 (record 00ff, batch 3 partition 1)"
    letters = [
        _letter(0, "user_error", "enrich", read_at, json_letter),
        _letter(1, "undecodable", "events", "src:0@7", b"\xff"),
        _letter(2, "user_error", "total", "record 00ff (batch 3 partition 0)", json_letter),
        _letter(3, "user_error", "enrich", read_at, printed),
        _letter(4, "user_error", "enrich", read_at, json_letter, truncated=True),
        _letter(5, "window_closed", "total", read_at, json_letter),
        _letter(6, "user_error", "enrich", read_at, json_letter, with_id=False),
    ]
    found = plan_replay(p, p.plan(), letters, "dead")
    redriven, resent = found.sends
    assert redriven.topic == "src" and redriven.value == b'{"n": 3}'
    headers = dict(redriven.headers)
    assert headers[ids.REDRIVE_HEADER] == b"enrich"
    assert headers[ids.ID_HEADER] == ids.from_dead_letter((0).to_bytes(16, "big"))
    assert ids.parse_ts_header(headers[ids.TS_HEADER]) == T0
    assert resent.value == b"\xff" and ids.REDRIVE_HEADER not in dict(resent.headers)
    assert sum(found.skipped.values()) == 5 and found.next_offsets == {0: 7}
    reasons = " | ".join(found.skipped)
    for words in (
        "after a shuffle",
        "printed form",
        "cut to fit",
        "window_closed",
        "without an ID",
    ):
        assert words in reasons
    only = plan_replay(p, p.plan(), letters[:2], "dead", codes=["undecodable"])
    assert [s.value for s in only.sends] == [b"\xff"]


def test_a_replay_of_one_code_leaves_the_other_codes_for_their_own_replay(
    broker, redis_server, topic_name
):
    """``--code no_time`` first, ``--code user_error`` later: each finds its letters once.

    The letters of the two codes are interleaved in one dead-letter partition; a replay of
    one code passes over the other's letters and must not count them as replayed.
    """
    from onceflow.connectors.kafka.sink import ORIGIN_HEADER, STAGE_HEADER
    from onceflow.kernel import ids

    settings = KafkaSettings(broker.bootstrap)
    src = topic_name("src")
    p = _build(topic_name("codes"), src, "copy", "totals", broker.bootstrap, {"on": True})
    letters = []
    for n in range(8):
        code, stage = ("no_time", "events") if n % 2 == 0 else ("user_error", "enrich")
        value = (
            json.dumps({"n": n}).encode()
            if code == "no_time"
            else json.dumps({"value": json.dumps({"n": n}), "value_json": True, "ts": T0}).encode()
        )
        headers = [
            (CODE_HEADER, code.encode()),
            (STAGE_HEADER, stage.encode()),
            (ORIGIN_HEADER, f"{src}:0@{n}".encode()),
            (ids.ID_HEADER, n.to_bytes(16, "big")),
        ]
        letters.append((None, value, headers))
    produce(settings, f"{p.name}.dead-letters", letters, partitions=1)
    client = redis_server.client()

    def replayed(*codes: str) -> list[int]:
        found = replay(p, p.plan(), client, codes=codes)
        return sorted(json.loads(s.value)["n"] for s in found.sends)

    assert replayed("no_time") == [0, 2, 4, 6]
    assert replayed("user_error") == [1, 3, 5, 7], "the letters a replay of another code passed"
    assert replayed() == [] and replayed("no_time") == [] and replayed("user_error") == []
    sent = sorted(json.loads(r.value)["n"] for r in read_topic(settings, src))
    assert sent == list(range(8)), "each letter sent back once"
