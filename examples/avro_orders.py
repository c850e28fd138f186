"""Avro in, Avro out, with a schema registry: ``onceflow explain examples/avro_orders.py``.

docs/guide/sources-sinks.md (Avro and Protobuf with a schema registry) explains it. The
registry is ``$SCHEMA_REGISTRY_URL`` (default ``http://localhost:8081``); ``pip install
'onceflow[avro]'``. The source reads every version of ``Order`` as version 2 (records of
version 1 get ``qty`` = 1); the sink registers ``Line`` under ``lines-value``.
"""

import os

from onceflow import KafkaSink, KafkaSource, Pipeline
from onceflow.codecs import Avro

REGISTRY = os.environ.get("SCHEMA_REGISTRY_URL", "http://localhost:8081")
ORDER_V2 = {
    "type": "record",
    "name": "Order",
    "namespace": "shop",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "item", "type": "string"},
        {"name": "qty", "type": "int", "default": 1},  # added in version 2
    ],
}
LINE = {
    "type": "record",
    "name": "Line",
    "namespace": "shop",
    "fields": [{"name": "id", "type": "long"}, {"name": "label", "type": "string"}],
}

pipeline = Pipeline("avro-orders")
pipeline.read("orders", KafkaSource("orders", codec=Avro(REGISTRY, ORDER_V2))).map(
    "label", lambda o: {"id": o["id"], "label": f"{o['qty']} x {o['item']}"}
).write("lines", KafkaSink("lines", codec=Avro(REGISTRY, LINE)))
