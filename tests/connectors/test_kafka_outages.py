"""Kafka away and back under each Kafka path of a run, against a real broker killed with -9.

The broker here is this module's own (its tests kill and restart it). Each test takes it away
at a chosen point of a path (a range being read, a transaction before its marker, a commit),
brings it back after a few seconds, and checks the path's outcome: every record read once,
every record visible once to ``read_committed`` readers. A broker that stays away ends the
step with one line after the (shortened) bound; a broker away at start is waited for.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from onceflow.connectors.base import PoisonInTransaction, TaskInfo, TransactionBroken
from onceflow.connectors.kafka import KafkaSink, admin, transactional_writer, worker
from onceflow.connectors.kafka import writer as plain_writer
from onceflow.connectors.kafka.clients import (
    KafkaUnavailable,
    await_kafka,
    ensure_topics,
    new_producer,
)
from onceflow.connectors.kafka.connection import KAFKA_OUTAGE_WAIT_ENV, KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.kernel.records import Record
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.services import free_port

pytestmark = pytest.mark.kafka

DOWN_S = 2.0  # how long the broker stays away before it is started again
RANGE_RECORDS = 400
PADDING = b"x" * 50_000
CLIENTS = pytest.mark.parametrize(
    "client", ["python", pytest.param("confluent", marks=pytest.mark.long)]
)


@pytest.fixture(scope="module")
def kafka() -> Iterator[LocalKafka]:
    with LocalKafka() as server:
        yield server


@pytest.fixture(autouse=True)
def _quick(monkeypatch) -> None:
    """A producer silent for 6 s (not 20) is stuck, a commit unanswered for 6 s broken."""
    monkeypatch.setattr(plain_writer, "STUCK_S", 6.0)
    monkeypatch.setattr(transactional_writer, "COMMIT_TIMEOUT_S", 6.0)


@pytest.fixture
def broker(kafka: LocalKafka) -> Iterator[LocalKafka]:
    """The module's broker, running again after the test whatever it did to it."""
    yield kafka
    kafka.start()


def _back_later(kafka: LocalKafka, after_s: float = DOWN_S) -> threading.Thread:
    """Start the (killed) broker again in ``after_s``, in a thread."""

    def start() -> None:
        time.sleep(after_s)
        kafka.start()

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


def _records(n: int) -> list[Record]:
    now = int(time.time() * 1000)
    return [Record(uuid.uuid4().bytes, now, {"i": i}) for i in range(n)]


def _sink(kafka: LocalKafka, client: str, pipeline: str, **kw) -> KafkaSink:
    sink = KafkaSink(f"{pipeline}-out", bootstrap_servers=kafka.bootstrap, client=client, **kw)
    sink.prepare(pipeline, streaming=True)
    return sink


def _task(pipeline: str, attempt_id: int = 1) -> TaskInfo:
    return TaskInfo(pipeline, "out", 1, 0, 0, exactly_once=True, attempt_id=attempt_id)


def _deliver(writer, records: list[Record], write: bool = True) -> None:
    """What the runtime does (runtime/task/loop.py), Redis aside."""
    while True:
        try:
            if write:
                writer.write(records)
            while True:
                try:
                    writer.prepare()
                    break
                except PoisonInTransaction:  # none here: the records are small and fresh
                    raise AssertionError("no record here can be refused") from None
            writer.commit()
            return
        except TransactionBroken:
            if writer.recover():
                return
            write = True


def _ids(kafka: LocalKafka, topic: str) -> list[bytes]:
    return [r.headers["onceflow-id"] for r in read_topic(KafkaSettings(kafka.bootstrap), topic)]


@CLIENTS
def test_a_range_is_read_across_a_broker_restart(client, broker, monkeypatch):
    """The stall clock does not run while Kafka does not answer (here: 3 s of it would do).

    20 MB of records: more than either reader fetches ahead (kafka-python 1 MB a partition,
    librdkafka 16 MB), so the rest of the range is read from the restarted broker.
    """
    settings = KafkaSettings(broker.bootstrap)
    topic = f"range-{uuid.uuid4().hex[:8]}"
    ensure_topics(settings, [topic], 1)
    producer = new_producer("python", settings, {"acks": "all", "linger_ms": 5})
    for i in range(RANGE_RECORDS):
        producer.send(topic, None, b"%d:" % i + PADDING, None, None)
    producer.flush(60)
    producer.close(5)
    monkeypatch.setattr(worker, "STALL_SECONDS", 3.0)
    monkeypatch.setattr(worker, "QUIET_S", 0.5)
    monkeypatch.setattr(worker, "POLL_S", 0.2)
    got: list[int] = []
    restart = None
    for fetched in worker.fetch_range(settings, topic, 0, 0, RANGE_RECORDS, client=client):
        got.extend(fetched.offsets)
        if restart is None:
            broker.kill()
            restart = _back_later(broker)
    assert restart is not None
    restart.join()
    assert got == list(range(RANGE_RECORDS)), "every record once, in order"


@pytest.mark.parametrize("client", ["python", "confluent"])
@pytest.mark.long  # as the paused transactions of tests/exactly_once/test_broker_restarts.py
def test_a_transaction_kafka_broke_before_its_marker_is_written_again(client, broker):
    """Its records were sent, the broker killed: the redone transaction is the one visible."""
    pipeline = f"broke-{uuid.uuid4().hex[:8]}"
    sink = _sink(broker, client, pipeline)
    writer = sink.open(_task(pipeline))
    records = _records(200)
    writer.write(records)
    broker.kill()
    restart = _back_later(broker)
    _deliver(writer, records, write=False)
    restart.join()
    writer.close()
    assert sorted(_ids(broker, sink.topic)) == sorted(r.id for r in records)


@CLIENTS
def test_a_commit_kafka_did_not_answer_happens_once(client, broker):
    """Killed between prepare (the pending delivery is recorded there) and commit."""
    pipeline = f"commit-{uuid.uuid4().hex[:8]}"
    sink = _sink(broker, client, pipeline)
    writer = sink.open(_task(pipeline))
    records = _records(150)
    writer.write(records)
    writer.prepare()
    broker.kill()
    restart = _back_later(broker)
    try:
        writer.commit()
    except TransactionBroken:
        if not writer.recover():  # aborted: the runtime delivers again
            _deliver(writer, records)
    restart.join()
    writer.close()
    assert sorted(_ids(broker, sink.topic)) == sorted(r.id for r in records)


@CLIENTS
def test_a_plain_sink_rides_out_a_broker_restart(client, broker):
    """Every record arrives (a plain sink may write one twice: same ID, same value).

    The producer gives a record up after 3 s (its delivery timeout): the outage outlasts it,
    as a longer one outlasts the clients' defaults (kafka-python 2 minutes, librdkafka 5).
    """
    pipeline = f"plain-{uuid.uuid4().hex[:8]}"
    quick = {"delivery_timeout_ms": 3000, "request_timeout_ms": 2000, "linger_ms": 5}
    sink = _sink(broker, client, pipeline, transactional=False, producer_options=quick)
    writer = sink.open(_task(pipeline))
    records = _records(300)
    assert writer.write(records[:150]) == []
    broker.kill()
    restart = _back_later(broker)
    assert writer.write(records[150:]) == []
    assert writer.flush() == []
    restart.join()
    writer.close()
    assert set(_ids(broker, sink.topic)) == {r.id for r in records}


def test_a_broker_gone_for_good_ends_a_commit_in_one_line_after_the_bound(
    broker, monkeypatch, capfd
):
    """kafka-python's own commit waits for the coordinator without a limit."""
    monkeypatch.setenv(KAFKA_OUTAGE_WAIT_ENV, "4s")
    pipeline = f"gone-{uuid.uuid4().hex[:8]}"
    sink = _sink(broker, "python", pipeline)
    writer = sink.open(_task(pipeline))
    writer.write(_records(20))
    writer.prepare()
    broker.kill()
    with pytest.raises(KafkaUnavailable) as gone:
        try:
            writer.commit()
        except TransactionBroken:
            writer.recover()
    message = str(gone.value)
    assert "\n" not in message
    assert broker.bootstrap in message and "ONCEFLOW_KAFKA_OUTAGE_WAIT" in message
    assert "waiting for Kafka at" in capfd.readouterr().err, "no progress line"


def test_a_broker_down_at_start_is_waited_for_then_one_line():
    servers = f"127.0.0.1:{free_port()}"
    with pytest.raises(KafkaUnavailable) as down:
        await_kafka(KafkaSettings(servers, start_wait_s=3))
    message = str(down.value)
    assert "\n" not in message and servers in message
    assert "did not answer for 3 s" in message and "ONCEFLOW_KAFKA_START_WAIT" in message


def test_a_broker_that_comes_up_during_the_start_wait_is_used(broker, monkeypatch):
    monkeypatch.setattr(admin, "_answered", set())
    broker.stop()
    restart = _back_later(broker, 1.0)
    await_kafka(KafkaSettings(broker.bootstrap, start_wait_s=60))
    restart.join()
    ensure_topics(KafkaSettings(broker.bootstrap), [f"up-{uuid.uuid4().hex[:8]}"], 1)
