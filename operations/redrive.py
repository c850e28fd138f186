"""Sending dead letters back through their pipeline once their cause is fixed, exactly once.

``onceflow dead-letters replay FILE`` reads the pipeline's dead-letter topic from where the
last replay stopped and sends each letter that can be replayed back to the Kafka topic its
record was read from:

* a record the source could not read (``undecodable``, ``no_id``, ``no_time``) is sent again
  as it was, key and value, to be read afresh (the codec, id or timestamp function fixed);
* a record your code failed on (``user_error``) is sent as the failed node's input, as JSON,
  with the node's name in the ``onceflow-redrive`` header: the source stage feeds it to that
  node directly, so the nodes before it (whose effects for the record were applied the first
  time, such as a sibling sink) do not run again. Only nodes of a source's stage (before the
  first shuffle) can be fed so; letters of later stages are listed, not sent.

Exactly once: a replayed record's ID is derived from its letter's ID, so a letter sent twice
(the replay run again after a crash, before it saved how far it got) is a duplicate the
pipeline drops; how far each dead-letter partition was replayed is kept in the pipeline's
namespace *per code* (``--code``), so later replays send only newer letters, and a replay of
one code passes over the letters of others without taking them as replayed (a later replay of
those codes finds them). A record that fails again becomes a new
letter (with a new ID), which a later replay sends again. A replayed record keeps its event
time: replay within the dedup horizon, and expect letters older than a window's lateness to
come back as ``window_closed``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from onceflow.connectors.kafka import KafkaDeadLetterSink, KafkaSource
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.sink import (
    CODE_HEADER,
    ORIGIN_HEADER,
    STAGE_HEADER,
    TRUNCATED_HEADER,
)
from onceflow.connectors.kafka.topics import TopicRecord, read_topic
from onceflow.graph_optimizer.ir import Source
from onceflow.graph_optimizer.plan import Plan
from onceflow.kernel import ids
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace
from onceflow.pipeline.api import Pipeline

# Letters of a record the source could not read: sent again as they were.
RESEND = frozenset({"undecodable", "no_id", "no_time"})
REDRIVE = "user_error"  # a record user code failed on: sent to the node it failed in
REPLAYABLE = (*sorted(RESEND), REDRIVE)  # what a replay without --code replays
_ORIGIN = re.compile(r"^([A-Za-z0-9._-]+):(\d+)@(\d+)\b")


@dataclass(frozen=True)
class Replay:
    """One letter to send: where, and the record's key, value and headers."""

    topic: str
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int | None


@dataclass
class ReplayPlan:
    """What a replay found in the dead-letter topic: letters to send and letters left."""

    topic: str
    sends: list[Replay] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> letters
    next_offsets: dict[int, int] = field(default_factory=dict)  # partition -> next to read
    replayed_before: int = 0  # letters an earlier replay of their code sent (passed over)

    def text(self) -> str:
        """A short report for the command line."""
        lines = [f"dead-letter topic {self.topic!r}: {len(self.sends)} letter(s) to replay"]
        per_topic = Counter(s.topic for s in self.sends)
        lines += [f"  -> {topic}: {n}" for topic, n in sorted(per_topic.items())]
        if self.skipped:
            lines.append("left in the dead-letter topic:")
            lines += [f"  {n} {reason}" for reason, n in self.skipped.most_common()]
        return "\n".join(lines)


def dead_letter_topic(pipeline: Pipeline) -> tuple[str, KafkaSettings]:
    """The pipeline's dead-letter topic and how to reach it (a clear error if it has none).

    As a streaming run decides: the pipeline's ``dead_letters`` sink, else
    ``<name>.dead-letters`` on the cluster of its first Kafka source.
    """
    dead = pipeline.dead_letters
    if isinstance(dead, KafkaDeadLetterSink):
        return dead.topic, dead.settings
    kafka = [c for c in _sources(pipeline).values() if isinstance(c, KafkaSource)]
    if dead is None and kafka:
        return f"{pipeline.name}.dead-letters", kafka[0].settings
    where = "a Kafka source" if dead is None else dead.describe()
    msg = (
        f"pipeline {pipeline.name!r} has no dead-letter topic (its dead letters go to {where}); "
        "replay reads a Kafka dead-letter topic: pass dead_letters=KafkaDeadLetterSink(...)"
    )
    raise ConfigError(msg)


# A replay's progress: (code, dead-letter partition) -> the next offset to replay.
Cursors = Mapping[tuple[str, int], int]


def plan_replay(
    pipeline: Pipeline,
    plan: Plan,
    records: Iterable[TopicRecord],
    topic: str,
    codes: Sequence[str] = (),
    done: Cursors | None = None,
) -> ReplayPlan:
    """Sort the letters read from the dead-letter topic into sends and reasons to leave them.

    ``done``: how far earlier replays got per code; a letter before its code's cursor was
    sent already and is passed over.
    """
    feeds = _fed_nodes(pipeline, plan)
    found = ReplayPlan(topic)
    for record in records:
        found.next_offsets[record.partition] = record.offset + 1
        code = _code(record.headers)
        if done and record.offset < done.get((code, record.partition), 0):
            found.replayed_before += 1
            continue
        sent, reason = _replay_of(record, feeds, codes)
        if sent is None:
            found.skipped[reason] += 1
        else:
            found.sends.append(sent)
    return found


def replay(
    pipeline: Pipeline,
    plan: Plan,
    client: Any,
    *,
    codes: Sequence[str] = (),
    dry_run: bool = False,
    namespace: str | None = None,
) -> ReplayPlan:
    """Replay the letters since the last replay of their code; save how far each code got.

    The progress is saved once Kafka has every send (a crash before resends them, and the
    pipeline drops the second copies), and only for the codes asked for: the letters of other
    codes that this replay passed over stay for a replay of theirs.
    """
    topic, settings = dead_letter_topic(pipeline)
    key = Keyspace(namespace or pipeline.name).redrive
    asked = tuple(codes) or REPLAYABLE
    done = read_cursors(client.hgetall(key) or {})
    start = _start(done, asked)
    records = read_topic(settings, topic, start=start)
    found = plan_replay(pipeline, plan, records, topic, codes, done)
    if dry_run:
        return found
    _send(_source_settings(pipeline), found.sends)
    moved = advanced(done, asked, found.next_offsets)
    if moved:
        client.hset(key, mapping={cursor_field(c, p): o for (c, p), o in moved.items()})
    return found


def cursor_field(code: str, partition: int) -> str:
    """The field of the ``redrive`` hash that holds how far ``code`` got in ``partition``."""
    return f"{code}:{partition}"


def read_cursors(raw: Mapping[bytes, bytes]) -> dict[tuple[str, int], int]:
    """The ``redrive`` hash as cursors (fields of another form are not progress: ignored)."""
    out: dict[tuple[str, int], int] = {}
    for name, value in raw.items():
        code, _, partition = name.decode().rpartition(":")
        if code and partition.isdigit():
            out[(code, int(partition))] = int(value)
    return out


def _start(done: Cursors, asked: Sequence[str]) -> dict[int, int]:
    """Where to read each dead-letter partition from: the least advanced code asked for."""
    partitions = {p for _, p in done}
    return {p: min(done.get((c, p), 0) for c in asked) for p in partitions}


def advanced(
    done: Cursors, asked: Sequence[str], read_to: Mapping[int, int]
) -> dict[tuple[str, int], int]:
    """The cursors of the codes asked for, moved to where this replay read each partition."""
    return {(c, p): end for c in asked for p, end in read_to.items() if end > done.get((c, p), 0)}


def _code(headers: Mapping[str, bytes]) -> str:
    """A letter's code ('' for a letter without one)."""
    return bytes(headers.get(CODE_HEADER, b"")).decode(errors="replace")


def _replay_of(
    record: TopicRecord, feeds: Mapping[str, frozenset[str]], codes: Sequence[str]
) -> tuple[Replay | None, str]:
    """The send a letter makes, or None and why it stays."""
    headers = record.headers
    code = _code(headers)
    refused = _refused(headers, code, codes)
    if refused:
        return None, refused
    origin = bytes(headers.get(ORIGIN_HEADER, b"")).decode(errors="replace")
    match = _ORIGIN.match(origin)
    stage = bytes(headers.get(STAGE_HEADER, b"")).decode(errors="replace")
    if match is None:
        where = "a node after a shuffle" if code == REDRIVE else "a record"
        return None, f"{code} in {stage!r}: {where} not read from Kafka in its stage"
    topic = match.group(1)
    rid = ids.from_dead_letter(bytes(headers[ids.ID_HEADER]))
    if code in RESEND:
        # The ID header; the source's id function, when it has one, names the record instead.
        sent = Replay(topic, record.key, record.value or b"", ((ids.ID_HEADER, rid),), None)
        return _timed(sent, record), ""
    return _redrive(record, rid, topic, stage, feeds)


def _refused(headers: Mapping[str, bytes], code: str, codes: Sequence[str]) -> str:
    """Why a letter cannot be replayed whatever its origin ('' when it may be)."""
    if codes and code not in codes:
        return f"{code or 'unknown'} (not asked for)"
    if not headers.get(ids.ID_HEADER):
        return f"{code or 'unknown'} without an ID (written by an at-least-once run)"
    if TRUNCATED_HEADER in headers:
        return f"{code}: the letter was cut to fit the topic"
    if code not in RESEND and code != REDRIVE:
        return f"{code or 'unknown (an older letter)'}: not replayable"
    return ""


def _timed(sent: Replay, record: TopicRecord) -> Replay:
    """A resent source record keeps the event time it was read with (its Kafka timestamp)."""
    ts = headers_ts(record.headers)
    return Replay(sent.topic, sent.key, sent.value, sent.headers, ts)


def headers_ts(headers: Mapping[str, bytes]) -> int | None:
    """The event time an ``onceflow-ts`` header holds, if any (a Kafka timestamp is >= 0)."""
    try:
        ts = ids.parse_ts_header(headers.get(ids.TS_HEADER))
    except Exception:  # noqa: BLE001 - no (or a broken) header: the broker's time
        return None
    return ts if ts >= 0 else None


def _redrive(
    record: TopicRecord, rid: bytes, topic: str, stage: str, feeds: Mapping[str, frozenset[str]]
) -> tuple[Replay | None, str]:
    """A ``user_error`` letter sent to the node it failed in, when the source stage runs it."""
    try:
        letter = json.loads(record.value or b"")
    except ValueError:
        return None, "user_error: the letter is not JSON"
    if not letter.get("value_json") or "value_chars" in letter:
        return None, "user_error: the letter holds a printed form, not the record (not JSON)"
    if stage not in feeds.get(topic, frozenset()):
        return None, f"user_error in {stage!r}: a node after a shuffle cannot be fed again"
    ts = int(letter.get("ts", 0))
    headers = (
        (ids.ID_HEADER, rid),
        (ids.TS_HEADER, ids.ts_header(ts)),
        (ids.REDRIVE_HEADER, stage.encode()),
    )
    return Replay(topic, None, str(letter["value"]).encode(), headers, None), ""


def _sources(pipeline: Pipeline) -> dict[str, Any]:
    """The pipeline's source connectors by node name."""
    return {n.name: n.connector for n in pipeline.graph.nodes if isinstance(n, Source)}


def _fed_nodes(pipeline: Pipeline, plan: Plan) -> dict[str, frozenset[str]]:
    """Per Kafka topic: the nodes the stages reading it run (what a replay can feed)."""
    sources = _sources(pipeline)
    fed: dict[str, set[str]] = {}
    for stage in plan.stages:
        for name in stage.nodes:
            connector = sources.get(name)
            if isinstance(connector, KafkaSource):
                for topic in connector.topics:
                    fed.setdefault(topic, set()).update(stage.nodes)
    return {topic: frozenset(nodes) for topic, nodes in fed.items()}


def _source_settings(pipeline: Pipeline) -> dict[str, KafkaSettings]:
    """How to reach each topic the pipeline reads."""
    return {
        topic: c.settings
        for c in _sources(pipeline).values()
        if isinstance(c, KafkaSource)
        for topic in c.topics
    }


def _send(settings: Mapping[str, KafkaSettings], sends: Sequence[Replay]) -> None:
    """Send every replay, waiting until Kafka has them all (acks from every replica)."""
    from kafka import KafkaProducer

    by_cluster: dict[int, tuple[KafkaSettings, list[Replay]]] = {}
    for sent in sends:
        cluster = settings.get(sent.topic)
        if cluster is None:
            msg = (
                f"a dead letter came from topic {sent.topic!r}, which the pipeline no longer reads"
            )
            raise ConfigError(msg)
        by_cluster.setdefault(id(cluster), (cluster, []))[1].append(sent)
    for cluster, batch in by_cluster.values():
        producer = KafkaProducer(**cluster.client_config(), acks="all", linger_ms=5)
        try:
            futures = [
                producer.send(
                    s.topic,
                    key=s.key,
                    value=s.value,
                    headers=list(s.headers),
                    timestamp_ms=s.timestamp_ms,
                )
                for s in batch
            ]
            producer.flush(timeout=120)
            for f in futures:
                f.get(timeout=120)  # raises if Kafka refused one: progress is then not saved
        finally:
            producer.close()
