"""What the Kafka sink does about its topics: timestamps the topic keeps, and replication.

A record is stamped with its event time unless its topic would delete it on arrival
(retention) or refuse it (timestamp limits): then with the time of writing, its event time in
the ``onceflow-ts`` header, counted as restamped. Topics the sink creates get an explicit
replication factor (min(3, brokers), ``min.insync.replicas`` min(2, factor)), and a cluster
that does not replicate them is said once at the start. The rules are checked on their own,
then against the real (single) Apache Kafka broker with the sink's writers.
"""

from __future__ import annotations

import time
import uuid

import pytest
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewTopic

from onceflow.connectors.base import TaskInfo
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka import KafkaDeadLetterSink, KafkaSink
from onceflow.connectors.kafka.admin import (
    DAY_MS,
    LIMIT_SLACK_MS,
    TopicTimes,
    choose_replication,
    replication_notes,
)
from onceflow.connectors.kafka.clients import WORKER_CLIENTS
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.kernel import ids
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.records import Record

HOUR_MS = 3_600_000
NOW = 1_800_000_000_000
LONG_MAX = str(2**63 - 1)


# -- the rules ----------------------------------------------------------------------------------


def test_a_topic_without_retention_or_limits_keeps_every_event_time():
    times = TopicTimes.of(
        {
            "cleanup.policy": "delete",
            "retention.ms": "-1",
            "message.timestamp.before.max.ms": LONG_MAX,
            "message.timestamp.after.max.ms": LONG_MAX,
        }
    )
    assert times == TopicTimes()
    assert times.keeps(NOW - 3650 * DAY_MS, NOW) and times.keeps(NOW + 3650 * DAY_MS, NOW)


def test_retention_keeps_event_times_that_stay_at_least_a_day():
    times = TopicTimes.of({"cleanup.policy": "delete", "retention.ms": str(7 * DAY_MS)})
    assert times.keeps(NOW - 6 * DAY_MS + 1000, NOW)
    assert not times.keeps(NOW - 6 * DAY_MS - 1000, NOW), "gone within a day: restamp"
    assert not times.keeps(NOW - 30 * DAY_MS, NOW)
    assert times.keeps(NOW + 3650 * DAY_MS, NOW), "no limit ahead"
    short = TopicTimes.of({"retention.ms": str(HOUR_MS)})  # cleanup.policy defaults to delete
    assert short.keeps(NOW - HOUR_MS // 2 + 1000, NOW), "half the retention when under 2 days"
    assert not short.keeps(NOW - HOUR_MS // 2 - 1000, NOW)


def test_a_compacted_topic_deletes_nothing_for_its_age():
    compacted = TopicTimes.of({"cleanup.policy": "compact", "retention.ms": str(DAY_MS)})
    assert compacted.keeps(NOW - 30 * DAY_MS, NOW)
    both = TopicTimes.of({"cleanup.policy": "compact,delete", "retention.ms": str(DAY_MS)})
    assert not both.keeps(NOW - 30 * DAY_MS, NOW)


def test_timestamp_limits_are_kept_clear_of_by_a_margin():
    times = TopicTimes.of(
        {
            "message.timestamp.before.max.ms": str(HOUR_MS),
            "message.timestamp.after.max.ms": str(HOUR_MS),
        }
    )
    assert times.keeps(NOW - HOUR_MS + LIMIT_SLACK_MS + 1000, NOW)
    assert not times.keeps(NOW - HOUR_MS + LIMIT_SLACK_MS - 1000, NOW)
    assert times.keeps(NOW + HOUR_MS - LIMIT_SLACK_MS - 1000, NOW)
    assert not times.keeps(NOW + HOUR_MS - LIMIT_SLACK_MS + 1000, NOW)
    old = TopicTimes.of({"message.timestamp.difference.max.ms": str(HOUR_MS)})  # before 3.6
    assert old == TopicTimes(times.max_age_ms, times.max_lead_ms, old.why)


def test_a_topic_stamping_records_itself_has_no_bounds():
    log_append = {"message.timestamp.type": "LogAppendTime", "retention.ms": str(HOUR_MS)}
    assert TopicTimes.of(log_append) == TopicTimes()


@pytest.mark.parametrize(
    ("brokers", "asked", "factor", "min_insync"),
    [(1, None, 1, 1), (2, None, 2, 2), (5, None, 3, 2), (5, 2, 2, 2), (3, 1, 1, 1)],
)
def test_new_topics_get_three_replicas_or_every_broker(brokers, asked, factor, min_insync):
    chosen = choose_replication(brokers, asked, "KafkaSink('t')")
    assert (chosen.factor, chosen.min_insync) == (factor, min_insync)
    assert chosen.configs({})["min.insync.replicas"] == str(min_insync)
    assert chosen.configs({"min.insync.replicas": "1"})["min.insync.replicas"] == "1"


def test_a_replication_factor_the_cluster_cannot_hold_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"replication_factor=3, but .* has 2 broker") as e:
        choose_replication(2, 3, "KafkaSink('t')")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="1 or more"):
        choose_replication(2, 0, "KafkaSink('t')")
    unknown = choose_replication(None, None, "KafkaSink('t')")
    assert unknown.factor == -1 and unknown.configs({}) == {}, "the cluster's default decides"


def test_unreplicated_topics_are_named():
    (single,) = replication_notes(1, {"out": 1})
    assert single.startswith("single broker: Kafka's data is not replicated")
    ones = replication_notes(3, {"out": 1, "p.onceflow-deliveries": 3, "p.dead-letters": 1})
    assert [n.split(" has ")[0] for n in ones] == [
        "Kafka topic 'out'",
        "Kafka topic 'p.dead-letters'",
    ]
    assert "has replication factor 1 on a cluster of 3 brokers" in ones[0]
    assert replication_notes(3, {"out": 3, "p.dead-letters": 2}) == []
    assert replication_notes(None, {"out": 1}) == []


def test_the_timestamp_option_is_checked():
    with pytest.raises(ConnectorError, match="'event' or 'write'"):
        KafkaSink("t", timestamp="processing")  # type: ignore[arg-type]


# -- against the broker -------------------------------------------------------------------------

CLIENTS = pytest.mark.parametrize(
    "client", [WORKER_CLIENTS[0], pytest.param(WORKER_CLIENTS[1], marks=pytest.mark.long)]
)


def _create(bootstrap: str, topic: str, config: dict[str, str]) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, 1, 1, topic_configs=config)])
    finally:
        admin.close()


def _task(pipeline: str) -> TaskInfo:
    return TaskInfo(pipeline, "out", 1, 0, 0, exactly_once=True, attempt_id=1)


def _records(n: int, ts: int) -> list[Record]:
    return [Record(uuid.uuid4().bytes, ts + i, {"i": i}) for i in range(n)]


def _deliver(sink: KafkaSink, pipeline: str, records: list[Record]) -> dict[str, int]:
    """Write the records as a task does (in one transaction if transactional); its counts."""
    writer = sink.open(_task(pipeline))
    assert writer.write(records) == []
    if sink.transactional:
        writer.prepare()
        writer.commit()
    else:
        assert writer.flush() == []
    writer.close()
    counts = writer.counts()
    counts.pop("registrations", None)  # of the transactional id: not what these tests are about
    return counts


@pytest.mark.kafka
@CLIENTS
@pytest.mark.parametrize("transactional", [True, False], ids=["transactional", "plain"])
def test_a_backfill_older_than_the_topics_retention_is_stamped_with_the_time_of_writing(
    client, transactional, kafka_broker, topic_name
):
    """30-day-old events into a topic keeping 1 day: without the rule the broker deletes them
    at its next retention check (the test broker checks every second), unread."""
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("backfill"), topic_name("p")
    _create(kafka_broker.bootstrap, topic, {"retention.ms": str(DAY_MS)})
    sink = KafkaSink(
        topic, bootstrap_servers=kafka_broker.bootstrap, client=client, transactional=transactional
    )
    sink.prepare(pipeline, streaming=True)
    month_ago = int(time.time() * 1000) - 30 * DAY_MS
    records = _records(200, month_ago)
    recent = _records(50, int(time.time() * 1000) - HOUR_MS)
    before = int(time.time() * 1000)
    counts = _deliver(sink, pipeline, records + recent)

    assert counts == {"restamped": 200}
    found = {r.headers[ids.ID_HEADER]: r for r in read_topic(settings, topic)}
    assert sorted(found) == sorted(r.id for r in records + recent), "read_committed: all there"
    for rec in records:
        assert found[rec.id].timestamp >= before, "stamped with the time of writing"
        assert ids.parse_ts_header(found[rec.id].headers[ids.TS_HEADER]) == rec.ts
    assert all(found[r.id].timestamp == r.ts for r in recent), "kept: their event time"


@pytest.mark.kafka
@CLIENTS
def test_a_topic_refusing_old_timestamps_gets_the_time_of_writing_and_no_dead_letter(
    client, kafka_broker, topic_name
):
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("limits"), topic_name("p")
    _create(kafka_broker.bootstrap, topic, {"message.timestamp.before.max.ms": str(HOUR_MS)})
    sink = KafkaSink(topic, bootstrap_servers=kafka_broker.bootstrap, client=client)
    sink.prepare(pipeline, streaming=True)
    now = int(time.time() * 1000)
    records = _records(20, now - 2 * HOUR_MS) + _records(20, now) + _records(5, now + 3 * HOUR_MS)

    counts = _deliver(sink, pipeline, records)  # refused records would fail the assertion there

    assert counts == {"restamped": 25}, "two hours back, and ahead past the default 1 h"
    found = {r.headers[ids.ID_HEADER]: r for r in read_topic(settings, topic)}
    assert sorted(found) == sorted(r.id for r in records)
    assert all(ids.parse_ts_header(found[r.id].headers[ids.TS_HEADER]) == r.ts for r in records)


@pytest.mark.kafka
def test_timestamp_write_always_stamps_the_time_of_writing(kafka_broker, topic_name):
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("write"), topic_name("p")
    sink = KafkaSink(topic, bootstrap_servers=kafka_broker.bootstrap, timestamp="write")
    sink.prepare(pipeline, streaming=True)
    before = int(time.time() * 1000)
    records = _records(10, before - 60_000)
    assert _deliver(sink, pipeline, records) == {}, "nothing restamped: asked for"
    found = read_topic(settings, topic)
    assert len(found) == 10 and all(r.timestamp >= before for r in found)


@pytest.mark.kafka
def test_dead_letters_follow_the_same_rule(kafka_broker, topic_name):
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("dead"), topic_name("p")
    _create(kafka_broker.bootstrap, topic, {"retention.ms": str(DAY_MS)})
    sink = KafkaDeadLetterSink(topic, bootstrap_servers=kafka_broker.bootstrap)
    sink.prepare(pipeline, streaming=True)
    now = int(time.time() * 1000)
    old = Record(b"old", now - 30 * DAY_MS, {"error": "bad", "origin": "t:0@1", "stage": "s"})
    fresh = Record(b"new", now - HOUR_MS, {"error": "bad", "origin": "t:0@2", "stage": "s"})
    assert _deliver(sink, pipeline, [old, fresh]) == {"restamped": 1}
    found = {r.headers[ids.ID_HEADER]: r for r in read_topic(settings, topic)}
    assert found[b"old"].timestamp >= now and found[b"new"].timestamp == fresh.ts


@pytest.mark.kafka
def test_a_topic_whose_settings_cannot_be_read_keeps_event_times_and_says_so(
    kafka_broker, topic_name
):
    sink = KafkaSink(
        topic_name("gone"), bootstrap_servers=kafka_broker.bootstrap, create_topic=False
    )
    sink.prepare(topic_name("p"), streaming=False)
    assert sink.times == TopicTimes()
    assert any("cannot read the settings of Kafka topic" in n for n in sink.notes())


@pytest.mark.kafka
def test_topics_the_sink_creates_are_replicated_as_the_single_broker_allows(
    kafka_broker, topic_name
):
    topic, pipeline = topic_name("rf"), topic_name("p")
    sink = KafkaSink(topic, bootstrap_servers=kafka_broker.bootstrap)
    sink.prepare(pipeline, streaming=True)
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    try:
        described = admin.describe_topics([topic, sink.log_topic])
        configs = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, configs={"min.insync.replicas": None})]
        )
    finally:
        admin.close()
    assert [len(t["partitions"][0]["replica_nodes"]) for t in described] == [1, 1]
    assert configs["topic"][topic]["min.insync.replicas"]["value"] == "1"
    (note,) = sink.notes()
    assert note.startswith("single broker: Kafka's data is not replicated")
    with pytest.raises(ConfigError, match="has 1 broker"):
        KafkaSink(
            topic_name("rf3"), bootstrap_servers=kafka_broker.bootstrap, replication_factor=3
        ).prepare(pipeline, streaming=True)
