"""The shapes records take inside Onceflow, and what names a task.

These are the types the runtime and the exactly-once machinery (``dedup``, ``backup``) pass
each other, defined here so that neither has to import the other's internals.
"""

from __future__ import annotations

import base64
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple


class Guarantee(enum.Enum):
    """What a run promises, and so what each task must do."""

    BOUNDED = "bounded"  # one batch, state in memory, no IDs
    AT_LEAST_ONCE = "at-least-once"  # streaming, state in Redis, no IDs, no dedup
    EXACTLY_ONCE = "exactly-once"  # streaming, IDs, backup, dedup, atomic commits

    @property
    def ids(self) -> bool:
        """Whether records carry IDs."""
        return self is Guarantee.EXACTLY_ONCE

    @property
    def streaming(self) -> bool:
        """Whether keyed state outlives the task."""
        return self is not Guarantee.BOUNDED


# A record entering a stage: (inbound edge, ID, event time, encoded key, element). The key's
# encoded bytes travel with rows that arrive through an exchange (a combine reuses them) and
# are None otherwise. A plain tuple, not a NamedTuple: millions are built per second.
InRow = tuple[int, bytes, int, "bytes | None", Any]


@dataclass(frozen=True)
class TaskRef:
    """One task: the stage it runs, its micro-batch, partition and attempt, and its sinks.

    ``attempt`` counts the task's attempts; ``attempt_id`` is Spark's id of this attempt,
    which only grows while a driver lives (newer attempts have larger ids). ``sinks`` pairs
    the stage's output index of each sink it writes with the sink's name.
    """

    stage: str
    batch: int
    partition: int
    attempt: int = 0
    sinks: Sequence[tuple[int, str]] = ()
    attempt_id: int = 0


class Record(NamedTuple):
    """A record inside a stage: a 16-byte ID (b"" when IDs are off), event time in ms, element.

    A source says where it read the record, when it knows: the ``lane`` (a source partition,
    such as ``topic:partition``, whose event-time progress makes the watermark) and the
    ``offset`` in it; errors name them as ``lane@offset``.

    ``positional``: the ID is the record's position in a source that every attempt and replay
    of a micro-batch reads alike, partition by partition (offsets fixed in Spark's offset log
    before the batch runs). Such an ID can only come back in an attempt of the task that read
    it, never through another task or batch, so the task's backup is all the memory of it
    that dedup needs (see :mod:`onceflow.dedup.admission`). A position ID of a source that
    cannot promise this is not ``positional``.

    ``size``: the bytes the record was read from (key and value), which chunks are cut by and
    ``max_record_bytes`` is checked against (0: the source cannot say).

    ``fingerprint``: a checksum of what the source read (key and value bytes), 0 when unknown.
    A copy of a record carries the same; another record under the same ID (an upstream app
    that copied one ID header onto several records, an id function naming an entity rather
    than an event) does not, and is refused as an ID conflict rather than dropped as a copy.
    """

    id: bytes
    ts: int
    elem: Any
    lane: str | None = None
    offset: int | None = None
    positional: bool = False
    size: int = 0
    fingerprint: int = 0


class Output(NamedTuple):
    """A record leaving a stage, already encoded: what is backed up and then sent on.

    ``target`` indexes the stage's outputs (ports to other stages, then sinks); ``key`` holds
    the encoded key for keyed streams; ``value`` the encoded value (or element).
    """

    target: int
    id: bytes
    ts: int
    key: bytes | None
    value: bytes


def outputs_of(
    targets: Iterable[int],
    ids: Iterable[bytes],
    ts: Iterable[int],
    keys: Iterable[bytes | None],
    values: Iterable[bytes],
) -> list[Output]:
    """Outputs made of columns (``Output(*row)`` for each row, without a call of ours each)."""
    return list(
        map(tuple.__new__, repeat(Output), zip(targets, ids, ts, keys, values, strict=True))
    )


class Redrive(NamedTuple):
    """A record replayed from a dead letter: the input of ``node``, where it failed before.

    A source decodes a replayed record (``onceflow dead-letters replay``) into this element;
    the stage that holds ``node`` feeds ``value`` to it directly, so the nodes before it (whose
    effects for the record were applied the first time) do not run again.
    """

    node: str
    value: Any


@dataclass(frozen=True)
class DeadLetter:
    """A record that could not be processed, with the reason and where it came from.

    ``code`` names the kind of reason in one word (counted per kind); ``lost`` is how many
    input records the letter stands for (more than one for a gap in a source). ``json_value``:
    ``value`` is the failed node's input as JSON (so it can be replayed), not a printed form;
    ``raw_key`` is the Kafka key of an undecodable record.
    """

    id: bytes
    ts: int
    stage: str
    error: str
    origin: str
    raw: bytes | None = None  # the undecodable payload, when there is one
    value: str | None = None  # a printable form of a decoded value that failed later
    code: str = "error"
    lost: int = 1
    json_value: bool = False
    raw_key: bytes | None = None

    def to_element(self, payload_limit: int = 0) -> dict[str, Any]:
        """The dead letter as a plain, JSON-friendly element (what dead-letter sinks write).

        ``payload_limit`` (0: none) caps the payload it carries (``raw`` in bytes, ``value`` in
        characters): a letter for a record too large to process must not be as large itself
        (it is backed up in Redis and written to a sink like any output). A cut payload says
        its full size in ``raw_bytes`` or ``value_chars``; ``origin`` says where the record is.
        """
        out: dict[str, Any] = {
            "stage": self.stage,
            "error": self.error,
            "origin": self.origin,
            "id": self.id.hex(),
            "ts": self.ts,
            "code": self.code,
        }
        if self.lost != 1:
            out["lost"] = self.lost
        if self.raw is not None:
            raw = self.raw[:payload_limit] if payload_limit > 0 else self.raw
            out["raw_b64"] = base64.b64encode(raw).decode()
            if len(raw) < len(self.raw):
                out["raw_bytes"] = len(self.raw)
        if self.raw_key is not None:
            out["key_b64"] = base64.b64encode(self.raw_key).decode()
        if self.value is not None:
            value = self.value[:payload_limit] if payload_limit > 0 else self.value
            out["value"] = value
            if len(value) < len(self.value):
                out["value_chars"] = len(self.value)
            if self.json_value:
                out["value_json"] = True
        return out

    def payload_size(self) -> int:
        """The bytes (or characters) of payload the letter carries, before any cap."""
        return len(self.raw or b"") + len(self.value or "")


@dataclass
class StateWrite:
    """Changes to one stateful combine's keyed state in one partition.

    ``values`` maps encoded keys to their new encoded state, or None to delete the key.
    ``timers`` maps a timer kind (a sorted set per node and partition: ``event``,
    ``processing`` or ``expiry``) to key -> when (ms), or None to drop the key's timer.
    """

    values: dict[bytes, bytes | None] = field(default_factory=dict)
    timers: dict[str, dict[bytes, int | None]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.values) or any(self.timers.values())
