"""The pipeline the crash tests run: a non-deterministic map, a copy sink, a keyed count.

events (Kafka, IDs from the event_id field) -> enrich (adds random noise: non-deterministic)
  -> copy (Kafka sink)
  -> by-user -> count (keyed state in Redis) -> counts (Kafka sink)

Topics and the pipeline name come from the environment so each test has its own;
``ORDERS_HORIZON`` / ``ORDERS_BUCKET`` (e.g. ``5m`` / ``1m``) shorten the dedup horizon for
the GC tests; ``ORDERS_OUT_OF_ORDER`` (e.g. ``2m``) is how far behind its partition's newest
event a record may arrive on time; ``ORDERS_SLOW_MS`` makes the map take that long per record
(micro-batches long enough to signal a run in the middle of one); ``ORDERS_CLIENT``
(``python`` or ``confluent``) picks the Kafka client of the source and the sinks;
``ORDERS_TXN_TIMEOUT_MS`` sets the sinks' Kafka transaction timeout (a transaction left open
by a killed run then holds readers up that long, unless the rerun ends it);
``ORDERS_IDS=position`` drops the id function (each record's ID is its position: copies sent
upstream count twice) and ``ORDERS_CHUNK`` sets the records per atomic commit.
"""

import os
import random
import time

from onceflow import DedupConfig, EventTime, KafkaSink, KafkaSource, Pipeline

dedup = None
chunk = {"chunk_size": int(os.environ["ORDERS_CHUNK"])} if os.environ.get("ORDERS_CHUNK") else {}
if os.environ.get("ORDERS_HORIZON"):
    dedup = DedupConfig.of(
        horizon=os.environ["ORDERS_HORIZON"], bucket=os.environ.get("ORDERS_BUCKET", "1m"), **chunk
    )
elif chunk:
    dedup = DedupConfig(**chunk)
by_position = os.environ.get("ORDERS_IDS") == "position"
# ORDERS_PLAIN_SINK=1: the sinks write without Kafka transactions (copies possible, counted).
transactional = os.environ.get("ORDERS_PLAIN_SINK") != "1"
event_time = EventTime.of(out_of_orderness=os.environ.get("ORDERS_OUT_OF_ORDER", "0"))
slow_s = float(os.environ.get("ORDERS_SLOW_MS", "0")) / 1000
client = os.environ.get("ORDERS_CLIENT", "python")
options = {}
if os.environ.get("ORDERS_TXN_TIMEOUT_MS"):
    options["transaction_timeout_ms"] = int(os.environ["ORDERS_TXN_TIMEOUT_MS"])


def enrich(e):
    if slow_s:
        time.sleep(slow_s)
    return {**e, "noise": random.random()}


pipeline = Pipeline(os.environ["ORDERS_PIPELINE"], dedup=dedup, event_time=event_time)
enriched = pipeline.read(
    "events",
    KafkaSource(
        os.environ["ORDERS_IN"],
        id=None if by_position else lambda e: e["event_id"],
        timestamp=lambda e: e["ts"],
        client=client,
    ),
).map("enrich", enrich)
enriched.write(
    "copy",
    KafkaSink(
        os.environ["ORDERS_COPY"],
        transactional=transactional,
        client=client,
        producer_options=options,
    ),
)
(
    enriched.key_by("by-user", lambda e: e["user"])
    .count_per_key("count")
    .write(
        "counts",
        KafkaSink(
            os.environ["ORDERS_COUNTS"],
            transactional=transactional,
            client=client,
            producer_options=options,
        ),
    )
)
