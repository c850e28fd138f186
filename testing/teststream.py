"""An in-memory stream for tests, with event times, watermark and clock under control.

A :class:`TestStream` is a list of *steps*; each step is one micro-batch of a streaming run:

* :meth:`TestStream.add` — elements, with their event times;
* :meth:`TestStream.advance_watermark` — the stream's event time reaches ``t`` without a
  record (a heartbeat: the lane's progress, from which Onceflow computes the watermark);
  :meth:`TestStream.advance_watermark_to_end` moves it as far as the clock allows, so every
  window whose end has passed closes;
* :meth:`TestStream.advance_processing_time` — the batch clock moves on (processing-time
  triggers, time-to-live), then an empty micro-batch runs.

It stands in for a :class:`~onceflow.connectors.kafka.KafkaSource` (or any source) in
:func:`onceflow.testing.run_test`, in process or on Spark. The watermark follows Onceflow's
own rules (:mod:`onceflow.kernel.eventtime`): the watermark a micro-batch uses is computed when
it starts from what earlier batches committed, minus the pipeline's out-of-orderness, and it
never passes the batch's clock. So records added after ``advance_watermark(t)`` with event
times before ``t`` are late, and windows that a watermark advance passed fire in the
micro-batch after it (an extra one runs for them, as in production).

Record IDs come from the ``id`` function (so a repeated element with the same ID is a
duplicate, dropped as a copy sent twice to Kafka would be), else from the element's position
in the stream. Event times come from ``at=`` in :meth:`~TestStream.add`, else the
``timestamp`` function, else 0.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from onceflow.connectors.base import SourceCapabilities, SourceConnector, SourceRun
from onceflow.connectors.decoded import Decoded, Decoder, LaneProgress
from onceflow.kernel import codec, ids
from onceflow.kernel.durations import Duration, parse_duration_ms
from onceflow.kernel.errors import CodecError, ConfigError
from onceflow.kernel.records import DeadLetter, Record
from onceflow.kernel.windows import GLOBAL_END
from onceflow.testing.errors import TestInputError
from onceflow.testing.steps import CLOCK, RECORDS, SPLIT, WATERMARK, Step, lane_of, raw_rows

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession


class TestStream(SourceConnector):
    """Elements, watermark advances and clock advances, one micro-batch per step.

    >>> stream = (
    ...     TestStream(timestamp=lambda e: e["ts"])
    ...     .add([{"user": "a", "ts": 1_000}, {"user": "b", "ts": 2_000}])
    ...     .advance_watermark(60_000)
    ...     .add([{"user": "a", "ts": 3_000}])  # late for a 1-minute window
    ... )

    ``id`` and ``timestamp`` work as for :class:`~onceflow.connectors.kafka.KafkaSource`;
    when the stream replaces a source in :func:`onceflow.testing.run_test`, it uses that
    source's functions unless it has its own.
    """

    __test__ = False  # not a pytest test class, whatever its name says
    bounded = False

    def __init__(
        self,
        *,
        id: Callable[[Any], Any] | None = None,  # noqa: A002 - as KafkaSource's
        timestamp: Callable[[Any], int] | None = None,
    ) -> None:
        self.id_fn = id
        self.ts_fn = timestamp
        self.steps: list[Step] = []
        self.tick_file: str | None = None  # set on a run's copy (for_run) when windows need ticks
        # A Spark test run's file naming its Redis and namespace (where clock steps move the
        # batch clock): a file, so that a Redis password never travels in Spark's options.
        self.clock_file: str | None = None
        self._offset = 0

    # -- building ------------------------------------------------------------------------

    def add(self, elements: Iterable[Any], *, at: int | None = None) -> TestStream:
        """A micro-batch of ``elements``; event time ``at`` (ms) for all, if given."""
        if isinstance(elements, str | bytes | dict):
            msg = (
                f"add() takes an iterable of elements, got a single {type(elements).__name__}; "
                "wrap it in a list: add([element])"
            )
            raise TestInputError(msg)
        when = None if at is None else _event_time(at, "at")
        items = tuple((_encode(e), when) for e in elements)
        return self._step(Step(RECORDS, items, offset=self._offset), len(items))

    def add_timestamped(self, pairs: Iterable[tuple[Any, int]]) -> TestStream:
        """A micro-batch of ``(element, event time ms)`` pairs."""
        items = tuple((_encode(e), _event_time(ts, "event time")) for e, ts in pairs)
        return self._step(Step(RECORDS, items, offset=self._offset), len(items))

    def advance_watermark(self, t: int) -> TestStream:
        """A micro-batch in which the stream's event time reaches ``t`` ms (no record).

        The pipeline's watermark follows from the next micro-batch on (minus the pipeline's
        out-of-orderness, and never past the batch clock).
        """
        return self._step(Step(WATERMARK, ms=_event_time(t, "watermark")), 0)

    def advance_watermark_to_end(self) -> TestStream:
        """As :meth:`advance_watermark`, as far as the batch clock: windows that ended close.

        With event times far in the past (small synthetic ones), that is a jump of more than
        the dedup horizon: panes that then cross a boundary (a later exchange) are late
        there, as in production; advance step by step, or use times close to now.
        """
        return self._step(Step(WATERMARK, ms=GLOBAL_END), 0)

    def advance_processing_time(self, seconds: Duration) -> TestStream:
        """Move the batch clock on by ``seconds`` (or ``"5m"``, a timedelta); run an empty batch."""
        try:
            ms = parse_duration_ms(seconds, "processing time")
        except ConfigError as exc:
            raise TestInputError(str(exc)) from None
        if ms <= 0:
            msg = f"advance_processing_time needs a positive duration, got {seconds!r}"
            raise TestInputError(msg)
        return self._step(Step(CLOCK, ms=ms), 0)

    def _step(self, step: Step, records: int) -> TestStream:
        self.steps.append(step)
        self._offset += records
        return self

    def with_defaults(
        self, id_fn: Callable[[Any], Any] | None, ts_fn: Callable[[Any], int] | None
    ) -> TestStream:
        """This stream, taking ``id_fn``/``ts_fn`` where it has no function of its own."""
        stream = TestStream(id=self.id_fn or id_fn, timestamp=self.ts_fn or ts_fn)
        stream.steps = list(self.steps)
        stream._offset = self._offset
        return stream

    # -- as a source ---------------------------------------------------------------------

    def capabilities(self) -> SourceCapabilities:
        """It ticks (windows close on a processing-time step with no input)."""
        return SourceCapabilities(ticks=True)

    def for_run(self, run: SourceRun) -> TestStream:
        """A copy with the run's tick file."""
        stream = copy.copy(self)
        stream.tick_file = run.tick_file
        return stream

    def describe(self) -> str:
        """One line for plans."""
        return f"test stream of {len(self.steps)} steps"

    def raw_rows(self, step: int) -> pa.RecordBatch:
        """The raw rows of one step (what Spark's reader produces for it)."""
        return raw_rows(step, self.steps[step].rows)

    def stream(self, session: SparkSession, pipeline: str, source: str) -> DataFrame:
        """The streaming DataFrame of raw rows (see :mod:`onceflow.testing.spark_stream`)."""
        from onceflow.testing.spark_stream import FORMAT, register  # imports pyspark

        register(session)
        config = {
            "kinds": [[s.kind, s.rows, s.ms] for s in self.steps],
            "tick_file": self.tick_file,
            "clock_file": self.clock_file,
        }
        return session.readStream.format(FORMAT).option("config", json.dumps(config)).load()

    def decoder(self, source: str, with_ids: bool) -> Decoder:
        """Raw rows ``(step, position)`` to records, heartbeats or dead letters."""
        steps, id_fn, ts_fn = self.steps, self.id_fn, self.ts_fn
        lane = lane_of(source)

        def decode(batch: pa.RecordBatch) -> Iterator[Decoded]:
            cols = zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True)
            for step_no, position in cols:
                step = steps[step_no]
                if step.kind == WATERMARK:
                    yield LaneProgress(lane, step.ms)
                    continue
                raw, at = step.items[position]
                offset = step.offset + position
                yield _record(source, lane, offset, raw, at, id_fn if with_ids else None, ts_fn)

        return decode


def _record(
    source: str,
    lane: str,
    offset: int,
    raw: bytes,
    at: int | None,
    id_fn: Callable[[Any], Any] | None,
    ts_fn: Callable[[Any], int] | None,
) -> Decoded:
    """One element as a record; a failing ``id``/``timestamp`` function makes a dead letter."""
    elem = codec.decode(raw)
    position = ids.from_position(source, SPLIT, 0, offset)
    origin = f"{lane}@{offset}"
    try:
        rid = ids.from_user_key(id_fn(elem)) if id_fn is not None else position
    except Exception as exc:  # noqa: BLE001 - user code: a dead letter, as for Kafka
        error = f"no record ID: {type(exc).__name__}: {exc}"
        return DeadLetter(position, 0, source, error, origin, value=repr(elem)[:500], code="no_id")
    try:
        ts = at if at is not None else (int(ts_fn(elem)) if ts_fn is not None else 0)
    except Exception as exc:  # noqa: BLE001 - user code
        error = f"no event time: {type(exc).__name__}: {exc}"
        return DeadLetter(rid, 0, source, error, origin, value=repr(elem)[:500], code="no_time")
    return Record(rid, ts, elem, lane, offset)


def _encode(element: Any) -> bytes:
    try:
        return codec.encode(element)
    except CodecError as exc:
        msg = f"a TestStream element cannot be encoded: {exc}"
        raise TestInputError(msg) from None


def _event_time(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{what} must be an int of milliseconds since the epoch, got {value!r}"
        raise TestInputError(msg)
    return value
