"""What the driver asks of a source through the connector interface, not through Kafka's modules.

The run's progress (consumer lag) reads where each partition ended from the source's
``positions``; a new Spark session gets each source's ``spark_conf`` and the user's, with the
``spark.jars`` of all of them joined once each.
"""

from __future__ import annotations

from types import SimpleNamespace

from onceflow.connectors.base import SourceConnector
from onceflow.connectors.kafka import KafkaSource
from onceflow.connectors.kafka.offsets import TICK
from onceflow.runtime.driver.startup import spark_conf


def test_a_kafka_source_reads_its_positions_from_either_client_s_checkpoint():
    source = KafkaSource("orders")
    python_client = {"orders:0": 5, "a:b:1": 7, TICK: 3}  # a topic name may hold ':'
    assert source.positions(python_client) == {("orders", 0): 5, ("a:b", 1): 7}
    spark_client = {"orders": {"0": 11, "2": 4}}
    assert source.positions(spark_client) == {("orders", 0): 11, ("orders", 2): 4}
    assert source.positions(None) == {}


class _Needs(SourceConnector):
    def __init__(self, conf: dict[str, str]) -> None:
        self.conf = conf

    def describe(self) -> str:
        return "needs"

    def decoder(self, source, with_ids):  # pragma: no cover - never read here
        raise AssertionError

    def spark_conf(self) -> dict[str, str]:
        return self.conf


def test_a_session_gets_every_source_s_settings_and_the_user_s_with_jars_joined():
    job = SimpleNamespace(
        sources=[
            ("a", _Needs({"spark.jars": "kafka.jar,common.jar", "spark.x": "1"})),
            ("b", KafkaSource("t")),  # the Python client: needs nothing
            ("c", _Needs({"spark.jars": "common.jar,other.jar"})),
        ]
    )
    user = {"spark.jars": "mine.jar,kafka.jar", "spark.x": "2"}
    assert spark_conf(job, user) == {  # type: ignore[arg-type]
        "spark.jars": "kafka.jar,common.jar,other.jar,mine.jar",
        "spark.x": "2",  # the user's setting wins
    }
    assert spark_conf(SimpleNamespace(sources=[("b", KafkaSource("t"))]), None) == {}  # type: ignore[arg-type]
