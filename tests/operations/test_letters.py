"""``onceflow dead-letters show``: letters printed readably, IDs in hex, origins and codes.

Issue 42: the letters of a dead-letter topic were only readable with a Kafka console
consumer, which printed the 16-byte ``onceflow-id`` header as garbage.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from kafka import KafkaProducer

from onceflow.cli.main import main


def test_a_bounded_runs_letters_file_is_shown(tmp_path, capsys):
    path = tmp_path / "dead-letters.jsonl"
    letter = {
        "stage": "by-customer",
        "error": "KeyError: 'customer' (at orders.py:12)",
        "origin": "orders:1@5042 (record 3f2a, batch 7 partition 1)",
        "id": "3f2a9c0e51d84b7aa2c6f1d0e9b8a7c6",
        "ts": 1_772_366_401_000,
        "code": "user_error",
        "value": '{"event_id": "e9"}',
        "value_json": True,
    }
    late = {**letter, "code": "late_for_join", "stage": "with-user.as-of", "id": ""}
    path.write_text(json.dumps(letter) + "\n" + json.dumps(late) + "\n")
    assert main(["dead-letters", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:5] == [
        f"{path}:1  user_error  stage 'by-customer'  event time 2026-03-01 12:00:01.000 UTC",
        "  id     3f2a9c0e51d84b7aa2c6f1d0e9b8a7c6",
        "  origin orders:1@5042 (record 3f2a, batch 7 partition 1)",
        "  error  KeyError: 'customer' (at orders.py:12)",
        '  value  {"event_id": "e9"}',
    ]
    assert "  id     (none: IDs were off)" in out
    assert main(["dead-letters", "show", str(path), "--code", "late_for_join", "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["code"] for x in shown] == ["late_for_join"]


PIPELINE = textwrap.dedent(
    """
    from onceflow import KafkaSink, KafkaSource, Pipeline

    pipeline = Pipeline(NAME)
    (
        pipeline.read("orders", KafkaSource(TOPIC, id=lambda o: o["event_id"]))
        .key_by("by-customer", lambda o: o["customer"])
        .count_per_key("count")
        .write("out", KafkaSink(TOPIC + "-out"))
    )
    """
)


@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.redis
def test_a_pipelines_dead_letter_topic_is_shown_with_hex_ids_and_origins(
    spark, broker, redis_server, tmp_path, topic_name, capsys, monkeypatch
):
    topic, name = topic_name("orders"), topic_name("letters")
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    for order in ({"event_id": "e1", "customer": "c1"}, {"event_id": "e2"}):
        producer.send(topic, json.dumps(order).encode(), partition=0)
    producer.send(topic, b"not json", partition=0)
    producer.flush()
    producer.close()
    path = tmp_path / "orders.py"
    path.write_text(f"NAME = {name!r}\nTOPIC = {topic!r}\n" + PIPELINE)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", broker.bootstrap)
    from onceflow.cli.loader import load_pipeline

    load_pipeline(str(path)).run(
        session=spark,
        redis_url=redis_server.url,
        available_now=True,
        checkpoint=os.path.join(tmp_path, "ckpt"),
        output_dir=str(tmp_path),
        progress=False,
    )
    assert main(["dead-letters", "show", str(path)]) == 0
    blocks = capsys.readouterr().out.strip().split("\n\n")
    assert len(blocks) == 2, blocks
    by_code = {b.split()[1]: b for b in blocks}
    failed = by_code["user_error"]
    assert failed.startswith(f"{name}.dead-letters:")
    assert "stage 'by-customer'" in failed
    assert f"  origin {topic}:0@1 (record " in failed
    assert "KeyError: 'customer'" in failed and '"event_id": "e2"' in failed
    rid = next(line.split()[1] for line in failed.splitlines() if line.startswith("  id "))
    assert len(rid) == 32 and int(rid, 16) >= 0, "the ID in hex"
    undecodable = by_code["undecodable"]
    assert f"  origin {topic}:0@2" in undecodable and "  value  not json" in undecodable
