"""``KafkaSource(client="spark")``: Spark's own Kafka connector, end to end in a fresh process.

Each run is a child process (one SparkContext per process; the session must load the
connector's jars when it starts, as ``spark_source.session_conf`` says). The pipeline copies
every record, with its ``t`` header, to an output topic; the test reads that topic back and
checks it independently: every input exactly once, headers carried. The last test kills a
run after one task of a micro-batch finished and resumes it: Spark's connector may order a
replayed batch's tasks differently, which lost records until ``spark_stream`` shuffled them
onto stable tasks. Skipped when the connector's jars cannot be fetched, or when they do not
link against the installed Spark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.kernel.errors import ServiceError
from onceflow.testing.harness import Crash, crash_and_resume

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

TAG = "t"
CAP = 400
CHILD_TIMEOUT_S = 600
# A connector built for another Spark that does not link shows up as one of these.
LINKAGE_ERRORS = (
    "NoSuchMethodError",
    "NoClassDefFoundError",
    "AbstractMethodError",
    "IncompatibleClassChangeError",
)


@pytest.fixture(scope="module")
def connector_jars() -> list[str]:
    from onceflow.connectors.kafka.spark_jars import connector_jars as jars

    try:
        return jars()
    except ServiceError as exc:
        pytest.skip(f"Spark's Kafka connector cannot be fetched: {exc}")


def _copy(envelope: dict[str, Any]) -> dict[str, Any]:
    tag = envelope["headers"].get(TAG)
    return {"id": envelope["value"]["id"], "tag": tag.decode() if tag is not None else None}


def child(spec: dict[str, Any]) -> None:
    """One run (in a fresh process): read the topics, copy every record to ``spec["out"]``."""
    from onceflow import KafkaSink, KafkaSource, Pipeline
    from onceflow.connectors.kafka.spark_source import session_conf
    from onceflow.runtime.spark_env.session import spark_session

    sources = [
        KafkaSource(topic, client=client, envelope=True, max_records_per_batch=CAP)
        for topic, client in spec["sources"]
    ]
    spark = spark_session("local[2]", app_name=spec["name"], extra_conf=session_conf(sources))
    p = Pipeline(spec["name"])
    streams = [p.read(f"in{i}", source) for i, source in enumerate(sources)]
    merged = streams[0] if len(streams) == 1 else p.merge("both", *streams)
    merged.map("copy", _copy).write("out", KafkaSink(spec["out"]))
    result = p.run(
        session=spark,
        redis_url=spec["redis_url"],
        available_now=True,
        checkpoint=spec["checkpoint"],
        output_dir=spec["output_dir"],
        progress=False,
    )
    print("RESULT " + json.dumps({"in": result.records_in, "dead": result.dead_letters}))


def run_child(spec: dict[str, Any], bootstrap: str) -> dict[str, int]:
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
    done = subprocess.run(
        [sys.executable, __file__, json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    output = done.stdout[-3000:] + done.stderr[-5000:]
    linkage = [e for e in LINKAGE_ERRORS if e in output]
    if linkage:
        pytest.skip(f"Spark's Kafka connector does not work with this Spark ({linkage}):\n{output}")
    raise AssertionError(f"child run failed ({done.returncode}):\n{output}")


def records(first: int, count: int) -> list[tuple[bytes | None, bytes, list[tuple[str, bytes]]]]:
    """JSON records ``{"id": i}``; every third carries the header ``t`` = ``tag-<i>``."""
    return [
        (None, json.dumps({"id": i}).encode(), [(TAG, f"tag-{i}".encode())] if i % 3 == 0 else [])
        for i in range(first, first + count)
    ]


def copies(kafka: KafkaSettings, topic: str) -> list[dict[str, Any]]:
    return [json.loads(r.value or b"null") for r in read_topic(kafka, topic)]


def assert_exactly(out: list[dict[str, Any]], ids: range) -> None:
    seen = Counter(o["id"] for o in out)
    assert set(seen) == set(ids), f"missing {sorted(set(ids) - set(seen))[:10]}"
    assert max(seen.values()) == 1, f"duplicated {[i for i, n in seen.items() if n > 1][:10]}"
    for o in out:
        assert o["tag"] == (f"tag-{o['id']}" if o["id"] % 3 == 0 else None), o


def spec(name: str, sources: list[tuple[str, str]], out: str, redis_url: str, tmp: Any) -> dict:
    return {
        "name": name,
        "sources": sources,
        "out": out,
        "redis_url": redis_url,
        "checkpoint": str(tmp / "ckpt"),
        "output_dir": str(tmp / "output"),
    }


@pytest.mark.long  # the kill test below reads every record once with this client too
def test_spark_client_reads_every_record_once_with_headers_and_resumes_after_a_restart(
    connector_jars, kafka_broker, redis_server, topic_name, tmp_path
):
    kafka = KafkaSettings(kafka_broker.bootstrap)
    topic, out = topic_name("spark-in"), topic_name("spark-out")
    produce(kafka, topic, records(0, 1000), partitions=2)
    run = spec(topic, [(topic, "spark")], out, redis_server.url, tmp_path)

    first = run_child(run, kafka_broker.bootstrap)
    assert first == {"in": 1000, "dead": 0}
    assert_exactly(copies(kafka, out), range(1000))

    produce(kafka, topic, records(1000, 500), partitions=2)
    second = run_child(run, kafka_broker.bootstrap)
    assert second == {"in": 500, "dead": 0}, "a restart reads from the checkpoint's offsets"
    assert_exactly(copies(kafka, out), range(1500))


@pytest.mark.long  # CI time (~21 s): the kill test above reads with Spark's client end to end
def test_both_clients_give_the_same_raw_rows_so_one_query_can_read_with_both(
    connector_jars, kafka_broker, redis_server, topic_name, tmp_path
):
    kafka = KafkaSettings(kafka_broker.bootstrap)
    by_spark, by_python, out = topic_name("sp"), topic_name("py"), topic_name("both-out")
    produce(kafka, by_spark, records(0, 600), partitions=2)
    produce(kafka, by_python, records(600, 600), partitions=1)
    run = spec(
        by_spark, [(by_spark, "spark"), (by_python, "python")], out, redis_server.url, tmp_path
    )

    assert run_child(run, kafka_broker.bootstrap) == {"in": 1200, "dead": 0}
    assert_exactly(copies(kafka, out), range(1200))


# ``onceflow run`` builds its own session; until the runtime passes the sources'
# ``session_conf`` to it, the pipeline file starts the session with the jars first.
CRASH_PIPELINE = """
import os
from onceflow import KafkaSink, KafkaSource, Pipeline
from onceflow.connectors.kafka.spark_source import session_conf
from onceflow.runtime.spark_env.session import spark_session

source = KafkaSource(os.environ["CRASH_IN"], client="spark", max_records_per_batch=300)
spark_session("local[2]", app_name=os.environ["CRASH_NAME"], extra_conf=session_conf([source]))
pipeline = Pipeline(os.environ["CRASH_NAME"])
pipeline.read("events", source).write("copy", KafkaSink(os.environ["CRASH_OUT"]))
"""


@pytest.mark.crash
def test_spark_client_is_exact_after_a_kill_once_a_task_of_the_batch_finished(
    connector_jars, kafka_broker, redis_server, topic_name, tmp_path
):
    kafka = KafkaSettings(kafka_broker.bootstrap)
    topic, out = topic_name("crash-in"), topic_name("crash-out")
    produce(kafka, topic, records(0, 3000), partitions=3)  # three: Spark orders them by map
    pipeline = tmp_path / "copy_pipeline.py"
    pipeline.write_text(CRASH_PIPELINE)
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_broker.bootstrap, "CRASH_IN": topic,
           "CRASH_OUT": out, "CRASH_NAME": topic}  # fmt: skip
    args = ["--available-now", "--redis-url", redis_server.url, "--checkpoint",
            str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "out")]  # fmt: skip
    crash = Crash("task_end", stage="events", batch=2, partition=0)

    first, second = crash_and_resume(str(pipeline), crash, args, env=env)

    assert first.crashed and second.returncode == 0
    ids = Counter(o["id"] for o in copies(kafka, out))
    assert set(ids) == set(range(3000)), f"lost {sorted(set(range(3000)) - set(ids))[:10]}"
    assert max(ids.values()) == 1


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
