"""Record IDs: 128 bits, global and stable across retries.

Where a record's ID comes from, in order of preference:

1. the ``onceflow-id`` Kafka header, set by an upstream Onceflow pipeline or producer: 16 bytes
   are the ID itself; any other non-empty value (a UUID or an order number as text, say) is
   read like a business key (a textual UUID keeps its 128 bits, anything else is hashed), so
   producers may send IDs as text or bytes; an empty header is an error (a dead letter);
2. a user function returning a business key (an event UUID, say), hashed to 128 bits
   unless it already is a UUID or 16 bytes;
3. the record's position: source stage name, topic, partition and offset. A lane (source,
   topic, partition) is hashed once; an offset then costs no hash: its first 8 bytes are the
   offset times an odd constant (a bijection of 64-bit numbers, so two offsets of a lane never
   share an ID, and the leading bytes, which pick a seen-ID shard, spread evenly) mixed with
   the lane's hash, its last 8 the lane's hash (:func:`from_positions` makes a slice's IDs at
   once).

A record produced by a stage takes an ID derived from its parent's ID, the name of the
boundary it crosses (an exchange or a sink) and its output index, so a retry that replays the
same parent yields the same children. IDs are only derived at boundaries: inside a fused
stage nothing needs one, and hashing once per hop would cost more than the work itself.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections import deque
from collections.abc import Sequence
from itertools import islice, repeat
from operator import eq
from typing import Any

from onceflow.kernel.errors import CodecError

ID_BYTES = 16
ID_HEADER = "onceflow-id"
TS_HEADER = "onceflow-ts"
# Set by Onceflow's own Kafka reader on a marker row standing for records deleted before they
# were read (retention, delete_records): "<first missing offset>-<first offset still there>".
GAP_HEADER = "onceflow-gap"
# A record re-sent from a dead letter (``onceflow dead-letters replay``): the name of the node
# whose input it is. Its value is that input as JSON, whatever the source's codec.
REDRIVE_HEADER = "onceflow-redrive"


def _hasher(domain: str) -> Any:
    return hashlib.blake2b(digest_size=ID_BYTES, key=hashlib.blake2b(domain.encode()).digest())


_POSITION = _hasher("onceflow/position")
_USER_KEY = _hasher("onceflow/user-key")
_REDRIVE = _hasher("onceflow/redrive")


def split_ids(blob: bytes, what: str = "a blob of IDs") -> list[bytes]:
    """16-byte IDs stored end to end, one by one; a clear error if they are not whole."""
    if len(blob) % ID_BYTES:
        msg = f"{what} ({len(blob)} bytes) is not whole {ID_BYTES}-byte IDs"
        raise CodecError(msg)
    return [blob[i : i + ID_BYTES] for i in range(0, len(blob), ID_BYTES)]


_SPREAD = 0x9E3779B97F4A7C15  # odd: multiplying by it is a bijection of 64-bit numbers
_U64 = (1 << 64) - 1


@functools.lru_cache(maxsize=4096)
def _lane_hash(source: str, topic: str, partition: int) -> tuple[int, bytes]:
    """A lane's hash: the number mixed into its offsets' leading bytes, and its last 8 bytes."""
    h = _POSITION.copy()
    h.update(f"{source}\0{topic}\0{partition}".encode())
    digest: bytes = h.digest()
    return int.from_bytes(digest[:8], "big"), digest[8:]


def from_position(source: str, topic: str, partition: int, offset: int) -> bytes:
    """ID of the record at ``topic``/``partition``/``offset`` as read by stage ``source``."""
    mix, tail = _lane_hash(source, topic, partition)
    return ((((offset & _U64) * _SPREAD) & _U64) ^ mix).to_bytes(8, "big") + tail


def from_positions(source: str, topic: str, partition: int, offsets: list[int]) -> list[bytes]:
    """:func:`from_position` of every offset of one lane, made together (numpy, no hash)."""
    import numpy as np

    mix, tail = _lane_hash(source, topic, partition)
    n = len(offsets)
    rows = np.empty(n, dtype=[("head", ">u8"), ("tail", "V8")])
    with np.errstate(over="ignore"):
        heads = np.asarray(offsets, dtype=np.int64).astype(np.uint64) * np.uint64(_SPREAD)
    rows["head"] = heads ^ np.uint64(mix)
    rows["tail"] = np.frombuffer(tail, dtype="V8")[0]
    blob = rows.tobytes()
    return [blob[i : i + ID_BYTES] for i in range(0, n * ID_BYTES, ID_BYTES)]


_COPY, _UPDATE, _DIGEST = (getattr(type(_POSITION), m) for m in ("copy", "update", "digest"))


def _hash_all(base: Any, parts: Sequence[bytes]) -> list[bytes]:
    """``base`` updated with each of ``parts``, digested: one loop of C calls per step."""
    hashes = list(map(_COPY, repeat(base, len(parts))))
    deque(map(_UPDATE, hashes, parts), maxlen=0)
    return list(map(_DIGEST, hashes))


def from_dead_letter(letter_id: bytes) -> bytes:
    """The ID of the record replayed from the dead letter with ID ``letter_id``.

    The same letter replayed twice (a replay run again after a crash) gets the same ID, so the
    pipeline drops the second copy; a record that fails again is a new letter, with a new ID.
    """
    h = _REDRIVE.copy()
    h.update(letter_id)
    return h.digest()  # type: ignore[no-any-return]


def from_user_key(key: Any) -> bytes:
    """ID for a business key returned by a user function.

    A :class:`uuid.UUID` (or a string holding one) keeps its 128 bits; 16 raw bytes are taken
    as they are; any other str, bytes or int is hashed.
    """
    if isinstance(key, uuid.UUID):
        return key.bytes
    if isinstance(key, bytes | bytearray):
        if len(key) == ID_BYTES:
            return bytes(key)
        raw = bytes(key)
    elif isinstance(key, str):
        if len(key) == 36 and key.count("-") == 4:
            try:
                return uuid.UUID(key).bytes
            except ValueError:
                pass
        raw = key.encode()
    elif isinstance(key, int) and not isinstance(key, bool):
        raw = str(key).encode()
    else:
        msg = (
            f"an id function must return str, bytes, int or uuid.UUID, got "
            f"{type(key).__name__}; return the event's unique key"
        )
        raise CodecError(msg)
    h = _USER_KEY.copy()
    h.update(raw)
    return h.digest()  # type: ignore[no-any-return]


def from_user_keys(keys: Sequence[Any]) -> list[bytes]:
    """:func:`from_user_key` of every key (ints, or text that holds no UUID: hashed together)."""
    kinds = set(map(type, keys))
    if kinds == {int}:
        raws = list(map(str.encode, map(int.__repr__, keys)))
    elif kinds == {str} and 36 not in set(map(len, keys)):
        raws = list(map(str.encode, keys))
    else:
        return [from_user_key(k) for k in keys]
    return _hash_all(_USER_KEY, raws)


MAX_HEADER_ID_BYTES = 1024


def from_header(value: bytes | None) -> bytes:
    """The ID an ``onceflow-id`` header value stands for (see the module docstring).

    16 bytes are taken as they are. Other values are text or bytes naming the event: a UUID
    written as text keeps its 128 bits (so a producer writing the UUID's text and one writing
    its bytes agree), anything else is hashed. Empty or absurdly long values are refused.
    """
    if value is None or len(value) == 0:
        msg = f"the {ID_HEADER!r} header is empty; send the event's unique ID (16 bytes or text)"
        raise CodecError(msg)
    if len(value) == ID_BYTES:
        return bytes(value)
    if len(value) > MAX_HEADER_ID_BYTES:
        msg = (
            f"the {ID_HEADER!r} header holds {len(value)} bytes, more than {MAX_HEADER_ID_BYTES}; "
            "send the event's unique ID (16 bytes or a short text), not the event"
        )
        raise CodecError(msg)
    try:
        text = bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        return from_user_key(bytes(value))
    return from_user_key(text.strip())


class Deriver:
    """Derives child IDs for records crossing one named boundary."""

    __slots__ = ("_base",)

    def __init__(self, boundary: str) -> None:
        self._base = _hasher("onceflow/derive/" + boundary)

    def child(self, parent: bytes, index: int) -> bytes:
        """ID of output number ``index`` produced from ``parent``."""
        h = self._base.copy()
        h.update(parent)
        if index:
            h.update(index.to_bytes(8, "big"))
        return h.digest()  # type: ignore[no-any-return]

    def children(self, parents: Sequence[bytes]) -> list[bytes]:
        """:meth:`child` of each of ``parents``, numbered as outputs on a boundary are.

        An output's number is how many outputs of the same parent come right before it.
        """
        if not any(map(eq, parents, islice(parents, 1, None))):  # one output per parent
            return _hash_all(self._base, parents)
        out: list[bytes] = []
        prev, n = None, 0
        child = self.child
        for parent in parents:
            n = n + 1 if parent == prev else 0
            prev = parent
            out.append(child(parent, n))
        return out

    def of(self, *parts: bytes | str | int) -> bytes:
        """ID made of several parts (a batch number, a partition, an encoded key ...)."""
        h = self._base.copy()
        for part in parts:
            if isinstance(part, str):
                raw = part.encode()
            elif isinstance(part, int):
                raw = part.to_bytes(8, "big", signed=True)
            else:
                raw = part
            h.update(len(raw).to_bytes(4, "big"))
            h.update(raw)
        return h.digest()  # type: ignore[no-any-return]


def ts_header(ts_ms: int) -> bytes:
    """Encode an event timestamp for the ``onceflow-ts`` header."""
    return str(int(ts_ms)).encode()


_MIN_TS, _MAX_TS = -(2**63), 2**63 - 1


def check_event_time(ts: int) -> int:
    """``ts`` if it fits an event time (signed 64-bit milliseconds), else a CodecError."""
    if not _MIN_TS <= ts <= _MAX_TS:
        msg = f"event time {ts} does not fit 64-bit milliseconds"
        raise CodecError(msg)
    return ts


def parse_ts_header(value: bytes | None) -> int:
    """Decode an ``onceflow-ts`` header: decimal milliseconds (ASCII digits, optional '-')."""
    text = bytes(value or b"")
    digits = text[1:] if text.startswith(b"-") else text
    if not digits.isdigit() or len(digits) > 19:  # isdigit() on bytes: ASCII digits only
        msg = f"the {TS_HEADER!r} header must hold decimal milliseconds, found {text[:40]!r}"
        raise CodecError(msg)
    return check_event_time(int(text))
