"""The pipeline of the real-input tests: a copy of every event and a total per user.

events (Kafka; IDs from the event_id field when TOTALS_ID_FIELD is set (an id function wins
over the onceflow-id header), from an "id" field where an event has one and else the header
when it is "if-present", else from the header; event time from the ts field when
TOTALS_TS_FIELD is set, else the Kafka timestamp)
  -> enrich (an event with "blow_up" raises; one with "pad" grows by that many bytes)
  -> copy (Kafka sink; TOTALS_COPY_MAX_BYTES caps the producer's request size)
  -> by-user -> amount -> total (sum, keyed state in Redis) -> totals (Kafka sink)

Topics, the pipeline name and ``on_error`` (TOTALS_ON_ERROR) come from the environment;
TOTALS_CLIENT (``python`` or ``confluent``) picks the Kafka client of the source and the sinks,
TOTALS_PLAIN_SINK=1 writes the copy without Kafka transactions; TOTALS_HORIZON and
TOTALS_CHUNK_SIZE set the dedup horizon and the records per atomic commit, TOTALS_CHUNK_BYTES and
TOTALS_DELIVERY_BYTES the bytes per atomic commit and per delivery, TOTALS_MAX_RECORD_BYTES the
pipeline's max_record_bytes; TOTALS_SLOW_MS makes enrich take that long per record; with
TOTALS_GATE (a path) an event with "gate" waits in enrich until that file exists (a test holds
the run's end until an outside fault is over). TOTALS_PARQUET (a folder) also writes the
enriched events as Parquet files, TOTALS_JSONL (a folder) as JSON-lines files; TOTALS_PG_TABLE
as rows (event_id, user, amount, body: the event's document or "") of that PostgreSQL table at
PG_CONNINFO (the password in PGPASSWORD); TOTALS_ICEBERG (a folder) as such rows of the Iceberg
table onceflow.events in a SQL catalog (SQLite) and warehouse in that folder.

TOTALS_FIXED=1 is the fix of what made the poison records dead letters, for a replay of them
(``onceflow dead-letters replay``): enrich no longer fails on "blow_up", and the source reads
the torture's undecodable records (``{not json <marker>``) as an event of "u0" for 100 with
the marker as its event_id.

TOTALS_PER_USER (a topic) adds a process stage with user state and timers on the enriched
events: per-user (keyed by user) counts each user's events and keeps the user's document
(the "body" of the greatest event_id among the user's events that have one: state values of
up to a record's size) and writes, for every event, {event_id, user, seen: the user's count
with it, best, best_len: the kept document's event_id and length}. It rejects by content: an
event with "reject" raises after changing its state (a dead letter; the state must be as it
was), one with "timer_reject" sets a processing-time timer (tagged with its event_id) whose
on_timer changes the state and raises (a dead letter naming per-user/on_timer).
"""

import os
import time

from onceflow import DedupConfig, KafkaSink, KafkaSource, Pipeline
from onceflow.kernel.codec import CODECS, ValueCodec
from onceflow.state import ValueSpec

slow_s = float(os.environ.get("TOTALS_SLOW_MS", "0")) / 1000
gate = os.environ.get("TOTALS_GATE")


fixed = os.environ.get("TOTALS_FIXED") == "1"


def enrich(e):
    if slow_s:
        time.sleep(slow_s)
    if gate and e.get("gate"):
        deadline = time.monotonic() + 600
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.2)
    if e.get("blow_up") and not fixed:
        raise ValueError(f"event {e.get('event_id')} asked to blow up")
    if e.get("pad"):
        return {**e, "padding": "x" * int(e["pad"])}
    return e


def lenient_json(data):
    """JSON, and the torture's undecodable records as the events they were meant to be."""
    if data.startswith(b"{not json "):
        marker = data[len(b"{not json ") :].decode()
        return {"event_id": marker, "user": "u0", "amount": 100}
    return CODECS["json"].decode(data)


client = os.environ.get("TOTALS_CLIENT", "python")
source_options = {"client": client}
if fixed:
    source_options["codec"] = ValueCodec("json", lenient_json, CODECS["json"].encode)
if os.environ.get("TOTALS_ID_FIELD") == "if-present":
    source_options["id"] = lambda e: e.get("id")  # None: the onceflow-id header
elif os.environ.get("TOTALS_ID_FIELD"):
    source_options["id"] = lambda e: e["event_id"]
if os.environ.get("TOTALS_TS_FIELD"):
    source_options["timestamp"] = lambda e: e["ts"]
if os.environ.get("TOTALS_ON_DATA_LOSS"):
    source_options["on_data_loss"] = os.environ["TOTALS_ON_DATA_LOSS"]
copy_options = {}
if os.environ.get("TOTALS_COPY_MAX_BYTES"):
    copy_options["max_request_size"] = int(os.environ["TOTALS_COPY_MAX_BYTES"])
copy_transactional = os.environ.get("TOTALS_PLAIN_SINK") != "1"
dedup_options = {}
if "TOTALS_HORIZON" in os.environ:
    dedup_options["horizon"] = os.environ["TOTALS_HORIZON"]
for option in ("chunk_size", "chunk_bytes", "delivery_bytes"):
    if f"TOTALS_{option.upper()}" in os.environ:
        dedup_options[option] = int(os.environ[f"TOTALS_{option.upper()}"])
dedup = DedupConfig.of(**dedup_options) if dedup_options else None
limits = {}
if "TOTALS_MAX_RECORD_BYTES" in os.environ:
    limits["max_record_bytes"] = int(os.environ["TOTALS_MAX_RECORD_BYTES"])

pipeline = Pipeline(
    os.environ["TOTALS_PIPELINE"],
    on_error=os.environ.get("TOTALS_ON_ERROR", "dead_letter"),
    dedup=dedup,
    **limits,
)
enriched = pipeline.read("events", KafkaSource(os.environ["TOTALS_IN"], **source_options)).map(
    "enrich", enrich
)
enriched.write(
    "copy",
    KafkaSink(
        os.environ["TOTALS_COPY"],
        producer_options=copy_options,
        client=client,
        transactional=copy_transactional,
    ),
)
(
    enriched.key_by("by-user", lambda e: e["user"])
    .map_values("amount", lambda e: e["amount"])
    .combine_per_key("total", "sum")
    .write("totals", KafkaSink(os.environ["TOTALS_OUT"], client=client))
)
if os.environ.get("TOTALS_PARQUET"):
    from onceflow.sinks import Parquet

    enriched.write("lake", Parquet(os.environ["TOTALS_PARQUET"]))
if os.environ.get("TOTALS_JSONL"):
    from onceflow.sinks import JsonLines

    enriched.write("jsonl", JsonLines(os.environ["TOTALS_JSONL"]))


def row(e):
    return {
        "event_id": e["event_id"],
        "user": e["user"],
        "amount": e["amount"],
        "body": e.get("body", ""),
    }


if os.environ.get("TOTALS_PG_TABLE") or os.environ.get("TOTALS_ICEBERG"):
    rows = enriched.map("row", row)
if os.environ.get("TOTALS_PG_TABLE"):
    from onceflow.connectors.postgres import PostgresSink

    rows.write(
        "db", PostgresSink(os.environ["TOTALS_PG_TABLE"], conninfo=os.environ["PG_CONNINFO"])
    )
if os.environ.get("TOTALS_ICEBERG"):
    from onceflow.sinks import Iceberg

    folder = os.environ["TOTALS_ICEBERG"]  # real_input.read_iceberg opens the same catalog
    os.makedirs(os.path.join(folder, "warehouse"), exist_ok=True)
    catalog = {
        "type": "sql",
        "uri": f"sqlite:///{os.path.join(folder, 'catalog.db')}",
        "warehouse": f"file://{os.path.join(folder, 'warehouse')}",
    }
    rows.write("ice", Iceberg("onceflow.events", catalog=catalog))

SEEN = ValueSpec("seen")  # the user's events so far
BEST = ValueSpec("best")  # [event_id, body] of the greatest event_id with a body


def per_user(user, e, ctx):
    seen = ctx.state(SEEN)
    seen.write((seen.read() or 0) + 1)
    if e.get("reject"):  # after a state change: a failing call must leave none
        raise ValueError(f"event {e['event_id']} rejected by per-user")
    best = ctx.state(BEST)
    kept = best.read()
    if e.get("body") and (kept is None or e["event_id"] > kept[0]):
        kept = [e["event_id"], e["body"]]
        best.write(kept)
    if e.get("timer_reject"):
        ctx.timers.set_processing_time(ctx.now, tag=f"t-{e['event_id']}")
    return [
        {
            "event_id": e["event_id"],
            "user": user,
            "seen": seen.read(),
            "best": kept[0] if kept else None,
            "best_len": len(kept[1]) if kept else 0,
        }
    ]


def per_user_timer(user, timer, ctx):
    seen = ctx.state(SEEN)
    seen.write((seen.read() or 0) + 1000)  # must be undone: the call fails
    raise ValueError(f"timer {timer.tag} of {user} timer-rejected")


if os.environ.get("TOTALS_PER_USER"):
    (
        enriched.key_by("user-key", lambda e: e["user"])
        .process("per-user", per_user, states=[SEEN, BEST], on_timer=per_user_timer)
        .write("per-user-out", KafkaSink(os.environ["TOTALS_PER_USER"], client=client))
    )
