"""The dead-letter sink: each letter's original payload as the value, the reason in headers.

A dead letter is never dropped: one too big for the topic has its payload shortened, and the
original size named in the ``onceflow-truncated`` header.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from onceflow.connectors.kafka.serialization import (
    CODE_HEADER,
    ERROR_HEADER,
    MAX_ERROR_HEADER,
    ORIGIN_HEADER,
    STAGE_HEADER,
    TRUNCATED_HEADER,
    record_size,
)
from onceflow.connectors.kafka.sink import KafkaSink
from onceflow.kernel.records import Record


class KafkaDeadLetterSink(KafkaSink):
    """Dead letters to a topic: the original payload as the value, the reason in headers.

    Stamped as :class:`KafkaSink` stamps records: a dead letter's event time may be what made
    it one (a wrong clock), and a topic that would delete or refuse it gets the time of
    writing instead; the event time is in the ``onceflow-ts`` header either way.
    """

    def __init__(self, topic: str, **kwargs: Any) -> None:
        super().__init__(topic, codec="json", **kwargs)

    def describe(self) -> str:
        """One line for plans."""
        return f"kafka dead letters {self.topic}"

    def encode(
        self, rec: Record, keyed: bool = False
    ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Raw payload (or the letter as JSON) and headers naming stage, error and origin.

        A letter for an undecodable record keeps its Kafka key as the key, so that the
        record, key and value, can be sent again once the cause is fixed.
        """
        letter = rec.elem
        raw = letter.get("raw_b64")
        value = base64.b64decode(raw) if raw is not None else json.dumps(letter).encode()
        raw_key = letter.get("key_b64") if raw is not None else None
        headers = [
            (ERROR_HEADER, str(letter.get("error", ""))[:MAX_ERROR_HEADER].encode()),
            (ORIGIN_HEADER, str(letter.get("origin", "")).encode()),
            (STAGE_HEADER, str(letter.get("stage", "")).encode()),
            (CODE_HEADER, str(letter.get("code", "")).encode()),
        ]
        return (base64.b64decode(raw_key) if raw_key else None), value, headers

    def record(
        self, rec: Record, limit: int, keyed: bool = False
    ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """As :meth:`KafkaSink.record`, but a dead letter too big for the topic is shortened.

        A dead letter is never dropped: its payload is cut to fit and the original size is
        named in the ``onceflow-truncated`` header.
        """
        key, value, headers = super().record(rec, limit, keyed)
        room = limit - record_size(key, None, headers) - MAX_ERROR_HEADER
        if value is not None and len(value) > room:
            headers = [*headers, (TRUNCATED_HEADER, str(len(value)).encode())]
            value = value[: max(0, room)]
        return key, value, headers
