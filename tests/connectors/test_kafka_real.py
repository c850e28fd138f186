"""What only a real Apache Kafka can show: records deleted below the read position, partitions
added while a pipeline was down, a compacted topic (tansu has neither delete_records nor
create_partitions), records the broker refuses to write (a topic's timestamp limit set while
the pipeline runs), and a backfill into topics whose retention or timestamp limits its event
times break. Each runs
``tests/e2e_pipelines/totals.py`` (most with both Kafka clients, kafka-python and
confluent-kafka) and checks it independently."""

from __future__ import annotations

import json
import time

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import (
    ConfigResource,
    ConfigResourceType,
    KafkaAdminClient,
    NewPartitions,
    NewTopic,
)

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.kernel import ids
from onceflow.kernel.keyspace import Keyspace
from onceflow.testing.harness import Crash, run_pipeline
from tests.exactly_once.real_input import PIPELINE, Send, event, new_run, stats, verify

pytestmark = [pytest.mark.kafka, pytest.mark.redis]
COMPACTION_WAIT_S = 120
COMPACTION_SETTLE_S = 2  # the broker's cleaner looks every 0.5 s (testing/kafka_config.py)
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
# confluent-kafka's variants run with --long: tests/connectors/test_kafka_clients.py and the
# confluent crash test keep that client in the default suite.
CLIENTS = pytest.mark.parametrize(
    "client", ["python", pytest.param("confluent", marks=pytest.mark.long)]
)


def _delete_below(bootstrap: str, topic: str, partition: int, offset: int) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.delete_records({TopicPartition(topic, partition): offset})
    finally:
        admin.close()


@CLIENTS
@pytest.mark.parametrize("mode", [pytest.param("fail", marks=pytest.mark.long), "report"])
def test_records_deleted_below_the_read_position_are_never_skipped_silently(
    mode, client, kafka_broker, redis_server, tmp_path
):
    run = new_run(
        kafka_broker,
        redis_server.url,
        tmp_path,
        partitions=1,
        TOTALS_ON_DATA_LOSS=mode,
        TOTALS_CLIENT=client,
    )
    run.cap = 100
    first = [event(run, f"u{i % 4}", 1) for i in range(100)]
    gone = [{"event_id": f"gone-{i}", "user": "u0", "amount": 1} for i in range(100)]
    later = [event(run, f"u{i % 4}", 1) for i in range(100)]
    # the pipeline reads the first 100 and stops; then 200 more arrive and retention (here:
    # delete_records) removes the first 100 of them before the pipeline runs again
    run.produce([Send(e, 0) for e in first])
    run_pipeline(PIPELINE, run.args(), env=run.env).check()
    run.produce([Send(e, 0) for e in gone + later])
    _delete_below(run.bootstrap, run.topics["in"], 0, 200)
    outcome = run_pipeline(PIPELINE, run.args(), env=run.env)
    if mode == "fail":
        assert outcome.returncode == 1, outcome.output[-2000:]
        assert "offsets 100..199 were deleted" in outcome.output
        assert "on_data_loss='report'" in outcome.output
        return
    outcome.check()
    run.poison["offsets 100..199 were deleted"] = "100 records lost upstream"
    verify(run, redis_server.client())
    assert stats(redis_server.client(), run)["data_loss"] == 100


@CLIENTS
def test_partitions_added_while_the_pipeline_was_down_are_read_from_their_log_start(
    client, kafka_broker, redis_server, tmp_path
):
    """Two partitions are added while the pipeline is down; retention (here: delete_records)
    takes the first 60 records of one of them before the pipeline sees it. Each new partition
    is read from its log start, and the 60 are reported as lost (``on_data_loss``)."""
    run = new_run(
        kafka_broker,
        redis_server.url,
        tmp_path,
        partitions=2,
        TOTALS_CLIENT=client,
        TOTALS_ON_DATA_LOSS="report",
    )
    run.produce([Send(event(run, f"u{i % 3}", 1), i % 2) for i in range(400)])
    run_pipeline(PIPELINE, run.args(), env=run.env).check()
    admin = KafkaAdminClient(bootstrap_servers=run.bootstrap)
    admin.create_partitions({run.topics["in"]: NewPartitions(total_count=4)})
    admin.close()
    gone = [Send({"event_id": f"gone-{i}", "user": "u0", "amount": 1}, 3) for i in range(60)]
    run.produce(gone + [Send(event(run, f"u{i % 3}", 2), i % 4) for i in range(400)])
    _delete_below(run.bootstrap, run.topics["in"], 3, 60)
    run_pipeline(PIPELINE, run.args(), env=run.env).check()
    run.poison["offsets 0..59 were deleted"] = "60 records lost upstream"
    verify(run, redis_server.client())
    assert stats(redis_server.client(), run)["data_loss"] == 60
    lanes = redis_server.client().hkeys(Keyspace(run.name).lanes)
    assert len(lanes) == 4, f"every partition reports its event time: {lanes}"


@CLIENTS
def test_a_compacted_topic_with_holes_in_its_offsets_is_read_to_its_end(
    client, kafka_broker, redis_server, tmp_path
):
    run = new_run(kafka_broker, redis_server.url, tmp_path, partitions=1, TOTALS_CLIENT=client)
    admin = KafkaAdminClient(bootstrap_servers=run.bootstrap)
    config = {
        "cleanup.policy": "compact",
        "segment.ms": "100",
        "min.cleanable.dirty.ratio": "0.0001",
        "delete.retention.ms": "100",
        "min.compaction.lag.ms": "0",
    }
    admin.create_topics([NewTopic(run.topics["in"], 1, 1, topic_configs=config)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=run.bootstrap, acks="all")
    for round_ in range(30):  # 20 keys updated every round, and one key written once per round
        for key in [*(f"k{k}" for k in range(20)), f"once-{round_}"]:
            value = {"event_id": f"{key}-r{round_}", "user": f"u{round_ % 4}", "amount": 1}
            producer.send(run.topics["in"], key=key.encode(), value=json.dumps(value).encode())
        producer.flush()
        time.sleep(0.05)
    producer.close()
    _wait_for_compaction(run.bootstrap, run.topics["in"], total=630)
    survivors = _stop_cleaning(run.bootstrap, run.topics["in"])
    offsets = [o for o, _ in survivors]
    assert offsets != list(range(offsets[0], offsets[0] + len(offsets))), "no holes yet"
    for _, value in survivors:
        run.expected[value["user"]] += 1
        run.events[value["event_id"]] += 1
    run_pipeline(PIPELINE, run.args(), env=run.env, timeout=300).check()
    assert _read(run.bootstrap, run.topics["in"]) == survivors, "compaction went on meanwhile"
    verify(run, redis_server.client())


@CLIENTS
@pytest.mark.parametrize(
    "transactional",
    [True, pytest.param(False, marks=pytest.mark.long)],  # CI time: the exactly-once sink first
    ids=["transactional", "plain"],
)
def test_records_the_broker_refuses_go_to_dead_letters_and_the_rest_is_written_once(
    client, transactional, kafka_broker, redis_server, tmp_path
):
    """Three records stamped two hours back sit among 600; after the first micro-batch the
    copy topic starts refusing timestamps over an hour old (an operator changed it while the
    pipeline ran: the sink, which read the topic's limits at the start, sends them as they
    are). The broker refuses those three: dead letters, and the rest is written once."""
    env = {"TOTALS_CLIENT": client, "TOTALS_PLAIN_SINK": "0" if transactional else "1"}
    run = new_run(kafka_broker, redis_server.url, tmp_path, **env)
    run.cap = 300
    now = int(time.time() * 1000)
    sends = [Send(event(run, f"u{i % 5}", 1), i % 2, timestamp_ms=now + i) for i in range(600)]
    for at in (400, 501, 502):  # past the first batch; two next to each other: one record batch
        old = event(run, "u1", 7)
        del run.events[old["event_id"]]  # its copy cannot be written: it is a dead letter
        run.poison[old["event_id"]] = "refused the record"
        sends.insert(at, Send(old, at % 2, timestamp_ms=now - 2 * HOUR_MS))
    run.produce(sends)
    limit = {"message.timestamp.before.max.ms": str(HOUR_MS)}
    run_pipeline(
        PIPELINE,
        run.args(),
        env=run.env,
        crash=Crash("batch_end", batch=0, mode="pause"),
        fault=lambda: _alter(run.bootstrap, run.topics["copy"], limit),
    ).check()
    verify(run, redis_server.client())  # the totals still count them: only the copy refused


def _alter(bootstrap: str, topic: str, config: dict[str, str]) -> None:
    """Set topic settings, and wait until the broker reports them (then it applies them)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs=config)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            asked = ConfigResource(ConfigResourceType.TOPIC, topic, configs=dict.fromkeys(config))
            found = admin.describe_configs([asked])["topic"][topic]
            if all(found.get(k, {}).get("value") == v for k, v in config.items()):
                return
            time.sleep(0.1)
        raise AssertionError(f"the broker did not apply {config} to {topic}")
    finally:
        admin.close()


def _read(bootstrap: str, topic: str) -> list[tuple[int, dict]]:
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=2000
    )
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    found = [(m.offset, json.loads(m.value)) for m in consumer]
    consumer.close()
    return found


def _stop_cleaning(bootstrap: str, topic: str) -> list[tuple[int, dict]]:
    """Turn the topic's log cleaner off (delete policy, kept forever), so the holes compaction
    left stay as they are while the pipeline reads; return what is left once reads agree."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        keep = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs=keep)])
    finally:
        admin.close()
    # a cleaning pass already under way when the policy changed may still finish: settle again
    return _wait_for_compaction(bootstrap, topic, total=630)


def _wait_for_compaction(bootstrap: str, topic: str, total: int) -> list[tuple[int, dict]]:
    """Read the topic until the log cleaner has compacted it and stopped; return what is left."""
    deadline = time.monotonic() + COMPACTION_WAIT_S
    previous: list[tuple[int, dict]] | None = None
    while True:
        found = _read(bootstrap, topic)
        if len(found) < total and found == previous:
            return found
        previous = found
        assert time.monotonic() < deadline, "the log cleaner never settled on the topic"
        time.sleep(COMPACTION_SETTLE_S)


def test_a_backfill_reaches_topics_that_would_delete_or_refuse_its_event_times(
    kafka_broker, redis_server, tmp_path
):
    """Events of 30 days ago; the copy topic keeps records a day, the totals topic refuses
    timestamps over an hour old. Each output is written once, stamped with the time of
    writing (counted), none is a dead letter; a pipeline reading the copies downstream gets
    their original event times. The run also says that the single broker replicates nothing."""
    run = new_run(kafka_broker, redis_server.url, tmp_path)
    admin = KafkaAdminClient(bootstrap_servers=run.bootstrap)
    admin.create_topics(
        [
            NewTopic(run.topics["copy"], 2, 1, topic_configs={"retention.ms": str(DAY_MS)}),
            NewTopic(
                run.topics["totals"],
                2,
                1,
                topic_configs={"message.timestamp.before.max.ms": str(HOUR_MS)},
            ),
        ]
    )
    admin.close()
    month_ago = int(time.time() * 1000) - 30 * DAY_MS
    sends = [
        Send(event(run, f"u{i % 5}", 1), i % 2, timestamp_ms=month_ago + i * 1000)
        for i in range(300)
    ]
    run.produce(sends)
    event_time = {s.value["event_id"]: s.timestamp_ms for s in sends}
    started = int(time.time() * 1000)
    outcome = run_pipeline(PIPELINE, [a for a in run.args() if a != "--no-progress"], env=run.env)
    outcome.check()
    assert "note: single broker: Kafka's data is not replicated" in outcome.output
    assert "stamped with the time of writing (copy 300, totals " in outcome.output
    verify(run, redis_server.client())  # every output once, and no dead letter
    copies = read_topic(KafkaSettings(run.bootstrap), run.topics["copy"])
    assert all(r.timestamp >= started for r in copies), "retention would delete event times"
    assert {
        json.loads(r.value)["event_id"]: ids.parse_ts_header(r.headers[ids.TS_HEADER])
        for r in copies
    } == event_time

    (tmp_path / "down").mkdir()
    down = new_run(kafka_broker, redis_server.url, tmp_path / "down")
    down.extra_env["TOTALS_IN"] = run.topics["copy"]
    down.expected, down.events = run.expected, run.events
    run_pipeline(PIPELINE, down.args(), env=down.env).check()
    verify(down, redis_server.client())
    again = read_topic(KafkaSettings(down.bootstrap), down.topics["copy"])
    assert {json.loads(r.value)["event_id"]: r.timestamp for r in again} == event_time
