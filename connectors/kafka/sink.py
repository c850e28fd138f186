"""The Kafka sink: each record written with its ID in the ``onceflow-id`` header.

Its event time goes in ``onceflow-ts``, so an Onceflow pipeline reading the topic stays
exactly-once end to end. Dead letters go to a topic of their own, with the original payload
as the value and the reason, origin and stage in headers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from onceflow.connectors.base import SinkConnector, SinkWriter, TaskInfo
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.clients import ensure_topics, shared_client
from onceflow.kernel import ids
from onceflow.kernel.codec import value_codec
from onceflow.kernel.errors import CodecError
from onceflow.kernel.records import Record
from onceflow.kernel.settings import KafkaSettings

ERROR_HEADER = "onceflow-error"
ORIGIN_HEADER = "onceflow-origin"
STAGE_HEADER = "onceflow-stage"
FLUSH_TIMEOUT_S = 120
MAX_ERROR_HEADER = 2000


def _key_bytes(key: Any) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    return json.dumps(key, separators=(",", ":")).encode()


class KafkaSink(SinkConnector):
    """Writes to a topic, each record carrying its ID; keyed elements ``(k, v)`` use ``k``.

    Delivery: a record is marked delivered once the broker acknowledged it (``acks=all``). A
    crash between the two can leave a second copy in the topic; it carries the same
    ``onceflow-id``, so Onceflow readers drop it and ``onceflow audit`` counts it.
    """

    def __init__(
        self,
        topic: str,
        *,
        bootstrap_servers: str | None = None,
        codec: str = "json",
        key: Callable[[Any], Any] | None = None,
        partitions: int = 2,
        create_topic: bool = True,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.topic = topic
        self._bootstrap = bootstrap_servers
        self._options = dict(options or {})
        self.codec = value_codec(codec)
        self.key_fn = key
        self.partitions = partitions
        self.create_topic = create_topic

    @property
    def settings(self) -> KafkaSettings:
        """Connection settings (arguments first, then the environment)."""
        return KafkaSettings.from_env(self._bootstrap, **self._options)

    def describe(self) -> str:
        """One line for plans."""
        return f"kafka {self.topic} ({self.codec.name})"

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Create the topic if asked to."""
        if self.create_topic:
            ensure_topics(self.settings, [self.topic], self.partitions)

    def open(self, task: TaskInfo) -> SinkWriter:
        """A writer sharing the worker's producer."""
        return _KafkaWriter(self, task)

    def encode(self, rec: Record) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Key, value and extra headers of one record."""
        elem = rec.elem
        if self.key_fn is not None:
            return _key_bytes(self.key_fn(elem)), self.codec.encode(elem), []
        if isinstance(elem, tuple) and len(elem) == 2:
            return _key_bytes(elem[0]), self.codec.encode(elem[1]), []
        return None, self.codec.encode(elem), []


class KafkaDeadLetterSink(KafkaSink):
    """Dead letters to a topic: the original payload as the value, the reason in headers."""

    def __init__(self, topic: str, **kwargs: Any) -> None:
        super().__init__(topic, codec="json", **kwargs)

    def describe(self) -> str:
        """One line for plans."""
        return f"kafka dead letters {self.topic}"

    def encode(self, rec: Record) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Raw payload (or the letter as JSON) and headers naming stage, error and origin."""
        import base64

        letter = rec.elem
        raw = letter.get("raw_b64")
        value = base64.b64decode(raw) if raw is not None else json.dumps(letter).encode()
        headers = [
            (ERROR_HEADER, str(letter.get("error", ""))[:MAX_ERROR_HEADER].encode()),
            (ORIGIN_HEADER, str(letter.get("origin", "")).encode()),
            (STAGE_HEADER, str(letter.get("stage", "")).encode()),
        ]
        return None, value, headers


class _KafkaWriter(SinkWriter):
    def __init__(self, sink: KafkaSink, task: TaskInfo) -> None:
        self.sink = sink
        self.producer = shared_client(
            "producer",
            sink.settings,
            acks="all",
            linger_ms=5,
            batch_size=256 * 1024,
            retries=10,
            max_in_flight_requests_per_connection=1,
            # Dedup is by onceflow-id, so the broker's idempotent producer adds nothing; and a
            # producer id reused across a crashed and a restarted process could let a broker
            # acknowledge a batch as a "duplicate sequence" without storing it.
            enable_idempotence=False,
        )
        self.futures: list[Any] = []

    def write(self, records: Sequence[Record]) -> None:
        send = self.producer.send
        topic = self.sink.topic
        for rec in records:
            try:
                key, value, extra = self.sink.encode(rec)
            except CodecError as exc:
                msg = f"cannot write to Kafka topic {topic!r}: {exc}"
                raise ConnectorError(msg) from exc
            headers = extra
            if rec.id:
                headers = [(ids.ID_HEADER, rec.id), (ids.TS_HEADER, ids.ts_header(rec.ts)), *extra]
            self.futures.append(
                send(
                    topic,
                    value=value,
                    key=key,
                    headers=headers or None,
                    timestamp_ms=rec.ts or None,
                )
            )

    def flush(self) -> None:
        """Return once the broker acknowledged everything written; raise if it refused any."""
        if not self.futures:
            return
        self.producer.flush(timeout=FLUSH_TIMEOUT_S)
        failed = [f for f in self.futures if f.failed() or not f.is_done]
        self.futures = []
        if failed:
            error = failed[0].exception if failed[0].is_done else "no acknowledgement"
            msg = f"Kafka did not accept {len(failed)} record(s) for {self.sink.topic!r}: {error}"
            raise ConnectorError(msg)

    def close(self) -> None:
        self.flush()

    def abort(self) -> None:
        self.futures = []
