"""The settings and command lines of a :class:`~onceflow.testing.kafka.LocalKafka` node.

A KRaft node on loopback with the broker and controller roles, set for tests
(:data:`TEST_SETTINGS`: replication factor 1 everywhere, no initial rebalance delay, quick
retention checks), logging through the Log4j 2 configuration :data:`LOG4J2_PROPERTIES`, in a
small, quickly started JVM (:data:`JVM_OPTIONS`).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from pathlib import Path

from onceflow.testing.kafka_jars import java_binary

MAIN_CLASS = "kafka.Kafka"
STORAGE_TOOL_CLASS = "kafka.tools.StorageTool"
# A small heap (the page cache holds the data, not the heap) and flags that start a JVM
# quickly: C1 only and the serial collector cut start-up by a second or more on two cores.
JVM_OPTIONS = (
    "-Xms64m",
    "-Xmx512m",
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseSerialGC",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
DEFAULT_HEAP = "512m"  # -Xmx of one broker; the nodes of a cluster take less each
CLUSTER_HEAP = "256m"
# The broker logs to standard output, which LocalKafka sends to its log file. The settings
# dumps (hundreds of lines, several per start) are left out: server.properties sits beside it.
LOG4J2_PROPERTIES = """\
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.target = SYSTEM_OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
logger.config.name = org.apache.kafka.common.config.AbstractConfig
logger.config.level = WARN
"""

NODE_ID = 1
LOOPBACK = "127.0.0.1"
# Topics the broker creates for itself: one replica each on one node, and few partitions so
# that the first consumer group or transaction does not wait for 50 partitions to be created.
INTERNAL_TOPIC_PARTITIONS = 5
TEST_SETTINGS: Mapping[str, str] = {
    "num.partitions": "2",
    "default.replication.factor": "1",
    "min.insync.replicas": "1",
    "auto.create.topics.enable": "true",
    "delete.topic.enable": "true",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": str(INTERNAL_TOPIC_PARTITIONS),
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": str(INTERNAL_TOPIC_PARTITIONS),
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    # Lets tests use short consumer session timeouts, so that a killed consumer's
    # partitions move quickly (Kafka's default minimum is 6 s).
    "group.min.session.timeout.ms": "1000",
    # No time-based retention unless a topic asks for it (retention.ms): retention judges a
    # record by its timestamp, and pipelines write event time (tests use fixed dates months
    # back), so Kafka's default of 7 days deletes their output within a retention check.
    "log.retention.ms": "-1",
    # Retention and delete_records take effect within a second, from the broker's start on.
    "log.retention.check.interval.ms": "1000",
    "log.initial.task.delay.ms": "0",
    "log.segment.delete.delay.ms": "1000",
    # The log cleaner looks for work twice a second, not every 15 s (compacted-topic tests).
    "log.cleaner.backoff.ms": "500",
    "file.delete.delay.ms": "1000",
    # After a kill -9 the restarted broker must wait for its previous registration to expire
    # before the controller takes it back: keep that wait short (Kafka's default is 9 s).
    "broker.session.timeout.ms": "3000",
    "broker.heartbeat.interval.ms": "500",
    # Two cores: fewer threads than Kafka's defaults.
    "num.network.threads": "2",
    "num.io.threads": "2",
    "background.threads": "2",
}


def new_cluster_id() -> str:
    """A random KRaft cluster id, as ``kafka-storage.sh random-uuid`` prints one."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")
        if not text.startswith("-"):  # Kafka never issues ids that look like an option
            return text


def broker_properties(
    port: int,
    controller_port: int,
    log_dir: str,
    node_id: int = NODE_ID,
    voters: str | None = None,
) -> dict[str, str]:
    """A KRaft broker+controller on loopback, with ``TEST_SETTINGS``.

    ``voters`` is the controller quorum (``id@host:port,...``); by default this node alone.
    """
    return {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": voters or f"{node_id}@{LOOPBACK}:{controller_port}",
        "listeners": f"PLAINTEXT://{LOOPBACK}:{port},CONTROLLER://{LOOPBACK}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{LOOPBACK}:{port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "log.dirs": log_dir,
        **TEST_SETTINGS,
    }


def java_command(home: Path, heap: str, log4j_path: str, main: str, *args: str) -> list[str]:
    """The command line that runs ``main`` of Kafka's jars in ``home`` with ``heap`` of heap."""
    return [
        java_binary(),
        *JVM_OPTIONS,
        f"-Xmx{heap}",  # after JVM_OPTIONS' own: the last -Xmx counts
        f"-Dlog4j2.configurationFile={log4j_path}",
        "-cp",
        str(home / "libs" / "*"),
        main,
        *args,
    ]
