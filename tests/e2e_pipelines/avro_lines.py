"""The schema registry crash test's pipeline: Avro orders in, Avro lines out.

orders (Kafka, Avro in the Confluent wire format, read as AVRO_ORDER's version 2 whatever
version wrote them) -> label -> lines (Kafka, Avro, registered under ``<topic>-value``).
Topics, the pipeline name and the registry URL come from the environment.
"""

import os

from onceflow import KafkaSink, KafkaSource, Pipeline
from onceflow.codecs import Avro
from tests.connectors.test_registry_pipeline import TOTAL, V2

registry = os.environ["AVRO_REGISTRY"]
pipeline = Pipeline(os.environ["AVRO_PIPELINE"])
pipeline.read("orders", KafkaSource(os.environ["AVRO_IN"], codec=Avro(registry, V2))).map(
    "label", lambda o: {"id": o["id"], "label": o["item"].upper(), "qty": o["qty"]}
).write("lines", KafkaSink(os.environ["AVRO_OUT"], codec=Avro(registry, TOTAL)))
