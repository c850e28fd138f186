"""Several Apache Kafka nodes on loopback: a cluster that keeps writing while a node is down.

``LocalKafkaCluster(brokers=3)`` runs three :class:`~onceflow.testing.kafka.LocalKafka` nodes,
each broker and controller, with replication factor 3 and ``min.insync.replicas`` 2, and
kills, stops and restarts one node at a time (a rolling restart, for the broker-restart
tests).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from onceflow.kernel.errors import ServiceError
from onceflow.testing.kafka import POLL_INTERVAL_S, PROBE_TIMEOUT_MS, LocalKafka
from onceflow.testing.kafka_config import CLUSTER_HEAP, LOOPBACK, new_cluster_id
from onceflow.testing.kafka_jars import KAFKA_VERSION
from onceflow.testing.services import free_port

# A cluster of three: what replication needs for a broker to go down without a write stopping
# (replication factor 3, min.insync.replicas 2, acks=all) and the internal topics alike.
CLUSTER_SETTINGS: Mapping[str, str] = {
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    "offsets.topic.replication.factor": "3",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
    # A restarted broker becomes leader of its partitions again soon (a rolling restart
    # otherwise leaves every leader on the node restarted first).
    "leader.imbalance.check.interval.seconds": "5",
    # Followers catch up and rejoin the in-sync set without waiting for Kafka's defaults.
    "replica.lag.time.max.ms": "5000",
    "num.replica.fetchers": "1",
}
IN_SYNC_TIMEOUT_S = 120.0


class LocalKafkaCluster:
    """``brokers`` Apache Kafka nodes (KRaft) on loopback, each broker and controller at once.

    Every node votes in the controller quorum, so a cluster of three keeps a quorum and two
    in-sync replicas while any one node is down: topics get replication factor 3 and
    ``min.insync.replicas`` 2 (:data:`CLUSTER_SETTINGS`, with :data:`TEST_SETTINGS`).
    ``kill(i)``, ``stop(i)``, ``start_node(i)`` and ``restart(i)`` act on node ``i`` (0-based);
    :meth:`wait_in_sync` waits until every replica is back in sync (do it between the steps of
    a rolling restart, as an operator would). ``bootstrap`` names every node. Each JVM gets
    :data:`CLUSTER_HEAP` of heap (the page cache holds the data).

    Measured on two busy cores (shared with other tests): start (three formats, three JVMs at
    once) ~12-20 s; a node's restart after ``kill`` ~8-10 s, back in sync ~0.1-0.5 s later;
    ~280 MB resident per node.
    """

    def __init__(
        self,
        brokers: int = 3,
        directory: str | None = None,
        properties: Mapping[str, str] | None = None,
        version: str = KAFKA_VERSION,
    ) -> None:
        self._owns_directory = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="onceflow-kafka-cluster-")
        ports = _distinct_ports(2 * brokers)
        pairs = [(ports[2 * i], ports[2 * i + 1]) for i in range(brokers)]
        voters = ",".join(f"{i + 1}@{LOOPBACK}:{c}" for i, (_, c) in enumerate(pairs))
        settings = {**CLUSTER_SETTINGS, **(properties or {})}
        cluster_id = new_cluster_id()
        self.nodes = [
            LocalKafka(
                os.path.join(self.directory, f"node-{i + 1}"),
                port,
                controller,
                version,
                settings,
                node_id=i + 1,
                voters=voters,
                cluster_id=cluster_id,
                heap=CLUSTER_HEAP,
            )
            for i, (port, controller) in enumerate(pairs)
        ]

    @property
    def bootstrap(self) -> str:
        """Every node: ``127.0.0.1:P1,127.0.0.1:P2,...``."""
        return ",".join(node.bootstrap for node in self.nodes)

    def start(self) -> LocalKafkaCluster:
        """Launch every node at once (formats too: a JVM each), then wait until each answers."""
        for node in self.nodes:
            os.makedirs(node.directory, exist_ok=True)
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(LocalKafka.launch, self.nodes))
        for node in self.nodes:
            node.wait_ready()
        return self

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``."""
        self.nodes[i].kill()

    def stop(self, i: int) -> None:
        """Shut node ``i`` down cleanly (its leaderships move first)."""
        self.nodes[i].stop()

    def start_node(self, i: int) -> None:
        """Start node ``i`` again on its directory and ports; wait until it answers."""
        self.nodes[i].start()

    def restart(self, i: int, kill: bool = True) -> None:
        """Kill (or stop) node ``i`` and start it again."""
        self.nodes[i].restart(kill=kill)

    def wait_in_sync(self, timeout_s: float = IN_SYNC_TIMEOUT_S) -> None:
        """Until every partition of every topic has all its replicas in sync."""
        from kafka import KafkaAdminClient

        deadline = time.monotonic() + timeout_s
        lagging: list[str] = ["(not asked yet)"]
        while time.monotonic() < deadline:
            try:
                admin = KafkaAdminClient(
                    bootstrap_servers=self.bootstrap, request_timeout_ms=PROBE_TIMEOUT_MS
                )
                try:
                    topics = admin.describe_topics()
                finally:
                    admin.close()
                lagging = [
                    f"{t['name']}:{p['partition_index']}"
                    for t in topics
                    for p in t["partitions"]
                    if p["error_code"] or len(p["isr_nodes"]) < len(p["replica_nodes"])
                ]
            except Exception as exc:  # noqa: BLE001 - a node still starting: ask again
                lagging = [f"{type(exc).__name__}: {exc}"]
            if not lagging:
                return
            time.sleep(POLL_INTERVAL_S * 5)
        msg = f"Kafka replicas not in sync within {timeout_s:.0f} s: {lagging[:5]}"
        raise ServiceError(msg)

    def close(self) -> None:
        """Stop every node, all at once (one by one, each waits for the others' shutdown)."""
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(LocalKafka.stop, self.nodes))

    def __enter__(self) -> LocalKafkaCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        if self._owns_directory and exc_type is None:
            shutil.rmtree(self.directory, ignore_errors=True)


def _distinct_ports(n: int) -> list[int]:
    """``n`` different loopback ports that were free a moment ago."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports
