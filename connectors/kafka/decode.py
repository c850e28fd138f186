"""How the Kafka source's raw records become records (see :mod:`.source` for the rules).

Record IDs: the user's ``id`` function, else the ``onceflow-id`` header, else the record's
position; event time: the ``onceflow-ts`` header, else the ``timestamp`` function, else the
Kafka timestamp. A record ``onceflow dead-letters replay`` sent (the ``onceflow-redrive``
header) is the input of the node it failed in (:class:`~onceflow.kernel.records.Redrive`).
Anything that cannot be decoded is a dead letter with its origin, never an error; only a
service the codec needs and cannot reach (a schema registry) fails the task instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat
from typing import TYPE_CHECKING, Any

import msgpack
from crc32c import crc32c

from onceflow.connectors import debezium
from onceflow.connectors.decoded import Decoded, Decoder, RecordColumns
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.offsets import tp_key
from onceflow.connectors.kafka.worker import RANGE_COLUMNS, fetch_range
from onceflow.kernel import ids
from onceflow.kernel.codec import ValueCodec
from onceflow.kernel.errors import ServiceError
from onceflow.kernel.eventtime import as_event_time, as_event_times
from onceflow.kernel.records import DeadLetter, Record, Redrive

if TYPE_CHECKING:
    import pyarrow as pa

RAW_COLUMN_COUNT = 7  # topic, partition, offset, ts, key, value, headers


def kafka_decoder(
    source: str,
    with_ids: bool,
    *,
    codecs: tuple[ValueCodec, ValueCodec],
    functions: tuple[Callable[[Any], Any] | None, Callable[[Any], int] | None],
    envelope: bool,
    by_position: bool,
    reader: tuple[KafkaSettings, str, str],
    changes: bool = False,
) -> Decoder:
    """The decoder of a Kafka source (see :meth:`.source.KafkaSource.decoder`).

    ``changes``: the values are Debezium change events (:mod:`onceflow.connectors.debezium`):
    each becomes a :class:`~onceflow.kernel.changes.Change`, identified by its place in the
    database's log unless ``id`` says otherwise, timed by its commit unless ``timestamp``
    does; Debezium's tombstones are skipped.
    """
    codec, key_codec = codecs
    id_fn, ts_fn = functions
    if changes:
        id_fn = id_fn or debezium.change_id
        ts_fn = ts_fn or debezium.change_time
    settings, on_data_loss, client = reader

    lanes: dict[tuple[str, int], str] = {}

    def lane_of(topic: str, part: int) -> str:
        lane = lanes.get((topic, part))
        if lane is None:
            lane = lanes[(topic, part)] = tp_key(topic, part)
        return lane

    def records(rows: Iterable[tuple[Any, ...]], unpack: bool) -> Iterator[Decoded]:
        """``(topic, partition, offset, ts, key, value, headers)`` rows, decoded one by one."""
        shape = CHANGES if changes else ENVELOPE if envelope else PLAIN
        for topic, part, offset, kts, key, value, headers in rows:
            if unpack:  # Arrow rows carry headers as MessagePack
                hdrs = dict(msgpack.unpackb(headers, raw=False)) if headers else {}
            else:
                hdrs = dict(headers) if headers else {}
            if changes and value is None and _gap_of(offset, kts, key, value, hdrs) is None:
                continue  # a Debezium tombstone: the delete before it said it all
            yield _decode_one(
                (source, lane_of(topic, part), topic, part, offset, kts, key, value, hdrs),
                codec,
                key_codec,
                shape,
                id_fn if with_ids else None,
                ts_fn,
                with_ids,
                by_position,
            )

    def lane_slice(topic: str, part: int, cols: Columns, unpack: bool) -> Iterator[Decoded]:
        """Records of one lane: as columns when every one is plain (:func:`plain_columns`).

        Else one by one, each bad record a dead letter saying what was wrong with it.
        """
        found = None
        if not envelope and not changes:
            found = plain_columns(
                (source, lane_of(topic, part), topic, part),
                cols,
                unpack,
                codec,
                (id_fn if with_ids else None, ts_fn),
                with_ids,
                by_position,
            )
        if found is not None:
            yield found
            return
        n = len(cols[0])
        yield from records(zip(repeat(topic, n), repeat(part, n), *cols, strict=True), unpack)

    def decode(batch: pa.RecordBatch) -> Iterator[Decoded]:
        if batch.num_columns == len(RANGE_COLUMNS):  # ranges: this task reads them
            ranges = zip(*(c.to_pylist() for c in batch.columns), strict=True)
            for topic, part, lo, hi in ranges:
                for f in fetch_range(settings, topic, part, lo, hi, on_data_loss, client):
                    cols = (f.offsets, f.timestamps, f.keys, f.values, f.headers)
                    yield from lane_slice(topic, part, cols, unpack=False)
            return
        topics, parts, *rest = (batch.column(i).to_pylist() for i in range(RAW_COLUMN_COUNT))
        for start, end in _runs(topics, parts):
            cols = tuple(c[start:end] for c in rest)
            yield from lane_slice(topics[start], parts[start], cols, unpack=True)

    return decode


# What a source's values are: plain values, envelopes with the Kafka metadata, Debezium events.
PLAIN, ENVELOPE, CHANGES = "plain", "envelope", "changes"
RawRecord = tuple[str, str, str, int, int, int, "bytes | None", "bytes | None", dict[str, bytes]]
# One lane's raw records as columns: offsets, Kafka timestamps, keys, values, headers.
Columns = tuple[list[int], list[int], list[Any], list[Any], list[Any]]
_PLAIN_HEADERS = frozenset((ids.ID_HEADER, ids.TS_HEADER))
_NO_HEADERS: dict[str, bytes] = {}


def _runs(topics: list[str], parts: list[int]) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each run of rows of one topic-partition, in order."""
    start = 0
    for i in range(1, len(topics)):
        if topics[i] != topics[start] or parts[i] != parts[start]:
            yield start, i
            start = i
    if topics:
        yield start, len(topics)


def plain_columns(
    where: tuple[str, str, str, int],
    cols: Columns,
    unpack: bool,
    codec: ValueCodec,
    functions: tuple[Callable[[Any], Any] | None, Callable[[Any], int] | None],
    with_ids: bool,
    by_position: bool,
) -> RecordColumns | None:
    """One lane's records decoded column by column, if every one of them is *plain*.

    Plain: no header but ``onceflow-id`` and ``onceflow-ts`` (no gap marker, no replayed dead
    letter), and nothing fails: the codec, the id and timestamp functions and the headers take
    every record. Then the result is field for field what :func:`_decode_one` gives each
    record, made by a list comprehension per field instead of a dozen calls per record
    (``tests/connectors/test_source_columns.py`` checks the two agree). Otherwise None: the
    caller decodes the lane record by record, and each bad record becomes its dead letter.
    ``functions``: the user's id function (None when IDs are off or not asked) and timestamp
    function; ``where``: source stage, lane, topic, partition.
    """
    source, lane, topic, part = where
    offsets, kts, keys, values, headers = cols
    id_fn, ts_fn = functions
    try:
        plain, hdrs = _plain_headers(headers, unpack)
        if not plain:
            return None
        elems = codec.decode_all(values)
        n = len(values)
        if with_ids:
            found = _found_ids(hdrs, id_fn, elems)
            rids = _with_positions(found, (source, topic, part), offsets)
            by_id = n - found.count(None)  # the records whose ID is not their position
            positional = (
                [by_position] * n if not by_id else [f is None and by_position for f in found]
            )
            fingerprints = [0] * n if not by_id else _fingerprints(keys, values, found)
        else:  # no IDs: no dedup, no fingerprints (see _decode_one)
            rids = [b""] * n
            positional = [False] * n
            fingerprints = [0] * n
        times = _event_times(hdrs, ts_fn, elems, kts)
    except Exception:  # noqa: BLE001 - record by record, each failure says what it is
        return None
    return RecordColumns(
        lane, rids, times, elems, list(offsets), positional, _sizes(keys, values), fingerprints
    )


def _fingerprints(keys: list[Any], values: list[Any], found: list[bytes | None]) -> list[int]:
    """:func:`fingerprint` of every record whose ID is no position (0 for the others)."""
    if keys.count(None) == len(keys) and None not in values and None not in found:
        return [c or 1 for c in map(crc32c, values)]  # crc32c(b"") is 0: no key, no seed
    return [
        (crc32c(v or b"", crc32c(k or b"")) or 1) if f is not None else 0
        for f, k, v in zip(found, keys, values, strict=True)
    ]


def _sizes(keys: list[Any], values: list[Any]) -> list[int]:
    """What each record was read from: its key and value bytes."""
    if keys.count(None) == len(keys) and None not in values:
        return list(map(len, values))
    return [
        (len(v) if v is not None else 0) + (len(k) if k is not None else 0)
        for k, v in zip(keys, values, strict=True)
    ]


def _with_positions(
    found: list[bytes | None], lane: tuple[str, str, int], offsets: list[int]
) -> list[bytes]:
    """The IDs found, each missing one the record's position ID."""
    if None not in found:
        return found  # type: ignore[return-value]
    positions = ids.from_positions(*lane, offsets)
    if found.count(None) == len(found):
        return positions
    return [f if f is not None else p for f, p in zip(found, positions, strict=True)]


def _plain_headers(headers: list[Any], unpack: bool) -> tuple[bool, list[dict[str, bytes]] | None]:
    """Whether every record's headers are plain; each one's as a dict (None: none has any)."""
    if not any(headers):
        return True, None
    if unpack:
        hdrs = [dict(msgpack.unpackb(h, raw=False)) if h else _NO_HEADERS for h in headers]
    else:
        hdrs = [dict(h) if h else _NO_HEADERS for h in headers]
    plain = _PLAIN_HEADERS
    return all(h.keys() <= plain for h in hdrs), hdrs


def _found_ids(
    hdrs: list[dict[str, bytes]] | None, id_fn: Callable[[Any], Any] | None, elems: list[Any]
) -> list[bytes | None]:
    """:func:`_record_id` of every record (None: the record's position is its ID)."""
    header = ids.ID_HEADER
    if id_fn is not None:
        keys = list(map(id_fn, elems))
        if hdrs is None:
            return ids.from_user_keys(keys)  # type: ignore[return-value]
        return [
            ids.from_user_key(k) if k is not None or header not in h else ids.from_header(h[header])
            for k, h in zip(keys, hdrs, strict=True)
        ]
    if hdrs is None:
        return [None] * len(elems)
    return [ids.from_header(h[header]) if header in h else None for h in hdrs]


def _event_times(
    hdrs: list[dict[str, bytes]] | None,
    ts_fn: Callable[[Any], int] | None,
    elems: list[Any],
    kts: list[int],
) -> list[int]:
    """:func:`_event_time` of every record."""
    header = ids.TS_HEADER
    if hdrs is not None and any(header in h for h in hdrs):
        return [_event_time(h, ts_fn, e, k) for h, e, k in zip(hdrs, elems, kts, strict=True)]
    if ts_fn is not None:
        return as_event_times(list(map(ts_fn, elems)))
    return [int(k) for k in kts]


def _decode_one(
    raw: RawRecord,
    codec: ValueCodec,
    key_codec: ValueCodec,
    shape: str,
    id_fn: Callable[[Any], Any] | None,
    ts_fn: Callable[[Any], int] | None,
    with_ids: bool,
    by_position: bool = False,
) -> Decoded:
    """One raw Kafka record as a record, or as a dead letter saying what was wrong with it.

    ``shape``: :data:`PLAIN`, :data:`ENVELOPE` or :data:`CHANGES`. ``by_position``: a record
    whose ID is its position is ``positional`` (see :meth:`KafkaSource.decoder`). The
    position ID is only computed where it is used.
    """
    source, lane, topic, part, offset, kts, key, value, hdrs = raw
    origin = f"{lane}@{offset}"
    gap = _gap_of(offset, kts, key, value, hdrs)
    if gap is not None:
        return _gap_letter(source, origin, _position(raw, with_ids), *gap)
    if ids.REDRIVE_HEADER in hdrs:
        return _replayed(raw, origin, with_ids)
    changes = shape == CHANGES
    try:
        elem = codec.decode(value) if value is not None else None
        if changes:
            elem = debezium.to_change(key_codec.decode(key) if key is not None else None, elem)
        elif shape == ENVELOPE:
            elem = {
                "key": key_codec.decode(key) if key is not None else None,
                "value": elem,
                "headers": hdrs,
                "topic": topic,
                "partition": part,
                "offset": offset,
                "timestamp": kts,
            }
    except ServiceError:  # a schema registry out of reach: the task fails, and is retried
        raise
    except Exception as exc:  # noqa: BLE001 - undecodable: dead letter
        what = f"a Debezium change event ({codec.name})" if changes else codec.name
        error = f"cannot decode as {what}: {type(exc).__name__}: {exc}"
        return DeadLetter(
            _position(raw, with_ids),
            kts,
            source,
            error,
            origin,
            raw=value or b"",
            code="undecodable",
            raw_key=key,
        )
    try:
        found = _record_id(hdrs, id_fn, elem) if with_ids else b""
    except Exception as exc:  # noqa: BLE001 - a bad header, or the user's id function failed
        error = f"no record ID: {type(exc).__name__}: {exc}"
        return DeadLetter(
            _position(raw, with_ids), kts, source, error, origin, raw=value or b"", code="no_id"
        )
    rid = _position(raw, with_ids) if found is None else found
    positional = found is None and by_position
    printed = 0  # b"": IDs are off; None: a position
    if found:
        printed = debezium.content_print(elem) if changes else fingerprint(key, value)
    try:
        ts = _event_time(hdrs, ts_fn, elem, kts)
    except Exception as exc:  # noqa: BLE001 - a bad header, or the user's timestamp function
        error = f"no event time: {type(exc).__name__}: {exc}"
        raw_value = value or b""
        return DeadLetter(rid, kts, source, error, origin, raw_value, code="no_time")
    size = (len(value) if value is not None else 0) + (len(key) if key is not None else 0)
    return Record(rid, ts, elem, lane, offset, positional, size, printed)


def _replayed(raw: RawRecord, origin: str, with_ids: bool) -> Decoded:
    """A record ``onceflow dead-letters replay`` sent: the input of the node it failed in.

    Its value is that input as JSON (whatever the source's codec), its ID and event time are
    in headers (set from the letter, so a second replay of the letter is a duplicate); the
    user's id and timestamp functions do not apply (they read source records, not inputs).
    """
    source, lane, _topic, _part, offset, kts, key, value, hdrs = raw
    try:
        node = bytes(hdrs[ids.REDRIVE_HEADER]).decode("utf-8")
        elem = json.loads(value or b"")
        rid = ids.from_header(hdrs.get(ids.ID_HEADER)) if with_ids else b""
        ts = ids.parse_ts_header(hdrs.get(ids.TS_HEADER))
    except Exception as exc:  # noqa: BLE001 - a malformed replay: dead letter, not a crash
        error = f"a replayed dead letter is malformed: {type(exc).__name__}: {exc}"
        position = _position(raw, with_ids)
        return DeadLetter(position, kts, source, error, origin, value or b"", code="undecodable")
    size = (len(value) if value is not None else 0) + (len(key) if key is not None else 0)
    return Record(rid, ts, Redrive(node, elem), lane, offset, False, size, fingerprint(key, value))


def fingerprint(key: bytes | None, value: bytes | None) -> int:
    """A record's content checksum (see :class:`~onceflow.kernel.records.Record`); never 0."""
    return crc32c(value or b"", crc32c(key or b"")) or 1


def _position(raw: RawRecord, with_ids: bool) -> bytes:
    """The ID of a raw record's position (``b""`` when IDs are off)."""
    source, _lane, topic, part, offset = raw[:5]
    return ids.from_position(source, topic, part, offset) if with_ids else b""


def _gap_of(
    offset: int, kts: int, key: bytes | None, value: bytes | None, hdrs: dict[str, bytes]
) -> tuple[int, int] | None:
    """``(first, after)`` if the row is the reader's own marker for deleted records.

    Only a row exactly as :func:`onceflow.connectors.kafka.worker._gap` makes it counts (no
    key, value or timestamp, the gap header alone, starting at the row's offset): a record
    that merely carries such a header (a producer set or forwarded it) is an ordinary record.
    """
    gap = hdrs.get(ids.GAP_HEADER)
    if gap is None or len(hdrs) != 1 or key is not None or value is not None or kts != 0:
        return None
    try:
        first, after = (int(x) for x in bytes(gap).decode("ascii").split("-"))
    except (ValueError, UnicodeDecodeError):
        return None
    return (first, after) if first == offset and after > first else None


def _gap_letter(source: str, origin: str, position: bytes, first: int, after: int) -> DeadLetter:
    """The dead letter standing for records deleted before the pipeline read them."""
    error = (
        f"offsets {first}..{after - 1} were deleted (retention or delete_records) before the "
        f"pipeline read them: {after - first} records lost upstream"
    )
    return DeadLetter(position, 0, source, error, origin, code="data_loss", lost=after - first)


def _record_id(
    headers: dict[str, bytes], id_fn: Callable[[Any], Any] | None, elem: Any
) -> bytes | None:
    """The user's id function, else the ``onceflow-id`` header; None: the position is the ID.

    What the user asked for wins over what the record carries (an app between two pipelines
    may copy one header onto several records). An id function that returns None for a record
    leaves it to the header; with no header either, that is an error (a dead letter).
    """
    if id_fn is not None:
        key = id_fn(elem)
        if key is not None or ids.ID_HEADER not in headers:
            return ids.from_user_key(key)
    if ids.ID_HEADER in headers:  # a header without a value is an error, not "no header"
        return ids.from_header(headers[ids.ID_HEADER])
    return None


def _event_time(
    headers: dict[str, bytes], ts_fn: Callable[[Any], int] | None, elem: Any, kafka_ts: int
) -> int:
    header = headers.get(ids.TS_HEADER)
    if header is not None:
        return ids.parse_ts_header(header)
    if ts_fn is not None:
        return as_event_time(ts_fn(elem))
    return int(kafka_ts)
