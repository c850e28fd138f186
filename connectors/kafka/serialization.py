"""How the Kafka sinks lay a record out: its key as bytes, the headers they write, its size.

The header names are part of the topic's format: a downstream Onceflow source reads
``onceflow-id`` and ``onceflow-ts`` (:mod:`onceflow.kernel.ids`), a person or a tool reading a
dead-letter topic reads the others.
"""

from __future__ import annotations

import json
from typing import Any

from onceflow.kernel.errors import CodecError

ERROR_HEADER = "onceflow-error"
ORIGIN_HEADER = "onceflow-origin"
STAGE_HEADER = "onceflow-stage"
CODE_HEADER = "onceflow-code"  # the letter's reason in one word (DeadLetter.code)
TRUNCATED_HEADER = "onceflow-truncated"
WINDOW_HEADER = "onceflow-window"  # "start,end" in ms, for window panes
PANE_HEADER = "onceflow-pane"  # "timing,index,final" (on_time,0,1), for window panes
MAX_ERROR_HEADER = 2000
# Record batch framing and per-record headers Kafka adds around key, value and headers.
RECORD_OVERHEAD_BYTES = 512

Headers = list[tuple[str, bytes]]


def key_bytes(key: Any) -> bytes | None:
    """A record key as Kafka takes it: bytes as they are, str as UTF-8, anything else as JSON."""
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    try:
        return json.dumps(key, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        msg = f"a Kafka record key must be str, bytes or JSON-able, got {type(key).__name__}"
        raise CodecError(msg) from exc


def record_size(key: bytes | None, value: bytes | None, headers: Headers) -> int:
    """The bytes of a record's key, value and headers (without Kafka's framing)."""
    return len(key or b"") + len(value or b"") + sum(len(k) + len(v) for k, v in headers)


def too_big(topic: str, size: int, limit: int) -> str:
    """Why a record of ``size`` bytes cannot go to ``topic``, and what to change."""
    return (
        f"the record is {size:,} bytes, more than the producer's max_request_size {limit:,} for "
        f"Kafka topic {topic!r}; shrink the record or raise max_request_size (and the topic's "
        "max.message.bytes)"
    )
