"""``onceflow dead-letters show``: a pipeline's dead letters, readable.

A letter in the dead-letter topic is the record's payload (an undecodable record's own bytes)
or the letter as JSON, with the reason in headers, and its ``onceflow-id`` header is 16 raw
bytes: a console consumer prints it as garbage. ``show`` reads the topic (or a JSON-lines
dead-letter file of a bounded run) and prints each letter as a few lines: where it sits in
the topic, its code, the stage, the event time, the record's ID in hex, where the record came
from (``topic:partition@offset`` when it was read in that stage), the reason and the value.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from onceflow.connectors.kafka.serialization import (
    CODE_HEADER,
    ERROR_HEADER,
    ORIGIN_HEADER,
    STAGE_HEADER,
    TRUNCATED_HEADER,
)
from onceflow.connectors.kafka.topics import TopicRecord
from onceflow.kernel import ids

VALUE_CHARS = 300  # a value longer than this is cut in the text (not in --json)


def from_topic(record: TopicRecord, topic: str) -> dict[str, Any]:
    """A letter read back from the dead-letter topic, as a JSON-lines sink would hold it."""
    headers = record.headers
    letter: dict[str, Any] = {}
    raw = record.value or b""
    try:
        parsed = json.loads(raw) if CODE_HEADER in headers else None
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and "code" in parsed and "stage" in parsed:
        letter.update(parsed)
    else:  # the record's own payload (an undecodable record)
        letter["raw_b64"] = base64.b64encode(raw).decode()
    for field, header in (
        ("code", CODE_HEADER),
        ("stage", STAGE_HEADER),
        ("origin", ORIGIN_HEADER),
        ("error", ERROR_HEADER),
    ):
        if field not in letter and header in headers:
            letter[field] = _text(headers[header])
    if "id" not in letter and headers.get(ids.ID_HEADER):
        letter["id"] = bytes(headers[ids.ID_HEADER]).hex()
    if "ts" not in letter and ids.TS_HEADER in headers:
        letter["ts"] = _ts_header(headers[ids.TS_HEADER])
    if TRUNCATED_HEADER in headers:
        letter["truncated_from"] = int(_text(headers[TRUNCATED_HEADER]) or 0)
    letter["at"] = f"{topic}:{record.partition}@{record.offset}"
    return letter


def from_json_lines(lines: Iterable[str], path: str) -> list[dict[str, Any]]:
    """The letters of a JSON-lines dead-letter file (a bounded run's), with their line."""
    letters = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            letter = json.loads(line)
            letter["at"] = f"{path}:{n}"
            letters.append(letter)
    return letters


def chosen(
    letters: Iterable[dict[str, Any]], codes: Sequence[str], limit: int | None
) -> list[dict[str, Any]]:
    """The letters of ``codes`` (all when empty), the last ``limit`` of them."""
    kept = [x for x in letters if not codes or x.get("code") in codes]
    return kept[-limit:] if limit else kept


def letter_text(letter: Mapping[str, Any]) -> str:
    """One letter as a few readable lines (IDs in hex, times in UTC)."""
    head = f"{letter.get('at', '?')}  {letter.get('code') or 'unknown'}"
    head += f"  stage {letter.get('stage', '?')!r}"
    if isinstance(letter.get("ts"), int):
        head += f"  event time {_utc(letter['ts'])}"
    lines = [head]
    rows = (
        ("id", letter.get("id") or "(none: IDs were off)"),
        ("origin", letter.get("origin")),
        ("error", letter.get("error")),
        ("value", _value(letter)),
    )
    lines += [f"  {name:<7}{text}" for name, text in rows if text]
    if letter.get("lost", 1) != 1:
        lines.append(f"  lost   {letter['lost']} records")
    return "\n".join(lines)


def _value(letter: Mapping[str, Any]) -> str | None:
    if "value" in letter:
        text = str(letter["value"])
        full = letter.get("value_chars")
    elif "raw_b64" in letter:
        raw = base64.b64decode(letter["raw_b64"])
        text = raw.decode("utf-8", errors="backslashreplace")
        full = letter.get("raw_bytes") or letter.get("truncated_from")
    else:
        return None
    cut = text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS] + "..."
    return cut + (f" (cut: {full} in all)" if full else "")


def _utc(ms: int) -> str:
    try:
        at = datetime.fromtimestamp(ms / 1000, UTC)
    except (OverflowError, OSError, ValueError):
        return f"{ms} ms"
    return at.strftime("%Y-%m-%d %H:%M:%S.") + f"{at.microsecond // 1000:03d} UTC"


def _text(value: bytes) -> str:
    return bytes(value).decode("utf-8", errors="replace")


def _ts_header(value: bytes) -> int | None:
    try:
        return ids.parse_ts_header(value)
    except Exception:  # noqa: BLE001 - a broken header: no time shown
        return None
