"""Bounded sources made in memory: a Python collection, or records generated from indexes.

Both read as ``spark.range(splits)`` and produce their records inside the first stage's own
pass (the decoder), so a collection costs no extra Python pass over the data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from onceflow.connectors.base import SourceConnector
from onceflow.connectors.decoded import Decoded, Decoder
from onceflow.connectors.errors import ConnectorError
from onceflow.kernel import codec, ids
from onceflow.kernel.errors import CodecError
from onceflow.kernel.eventtime import as_event_time
from onceflow.kernel.records import DeadLetter, Record

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession


def _id_and_ts(
    source: str,
    split: str,
    index: int,
    value: Any,
    id_fn: Callable[[Any], Any] | None,
    ts_fn: Callable[[Any], int] | None,
    with_ids: bool,
) -> tuple[bytes, int]:
    ts = as_event_time(ts_fn(value)) if ts_fn is not None else 0
    if not with_ids:
        return b"", ts
    if id_fn is not None:
        return ids.from_user_key(id_fn(value)), ts
    return ids.from_position(source, split, 0, index), ts


class Collection(SourceConnector):
    """Records from an in-memory sequence (encoded on the driver, checked up front).

    ``id`` (a function of the element) gives business-key IDs; ``timestamp`` (a function
    returning epoch milliseconds) gives event times, which windows use.
    """

    bounded = True

    def __init__(
        self,
        items: Iterable[Any],
        *,
        id: Callable[[Any], Any] | None = None,  # noqa: A002 - reads well at the call site
        timestamp: Callable[[Any], int] | None = None,
    ) -> None:
        try:
            self.encoded = [codec.encode(x) for x in items]
        except CodecError as exc:
            msg = f"a Collection item cannot be encoded: {exc}"
            raise ConnectorError(msg) from exc
        self.id_fn = id
        self.ts_fn = timestamp

    def describe(self) -> str:
        """One line for plans."""
        return f"collection of {len(self.encoded)} items"

    def frame(self, session: SparkSession, parallelism: int) -> DataFrame:
        """One row per split."""
        return split_frame(session, max(1, min(parallelism, len(self.encoded))))

    def decoder(self, source: str, with_ids: bool) -> Decoder:
        """Produce the split's items."""
        encoded, id_fn, ts_fn = self.encoded, self.id_fn, self.ts_fn

        def decode(batch: pa.RecordBatch) -> Iterator[Decoded]:
            for split, splits in splits_of(batch):
                lo, hi = _bounds(len(encoded), splits, split)
                for index in range(lo, hi):
                    raw = encoded[index]
                    value = codec.decode(raw)
                    yield _record(
                        source, "collection", index, value, id_fn, ts_fn, with_ids, len(raw)
                    )

        return decode


class Generate(SourceConnector):
    """``count`` records ``fn(i)`` for i in ``range(count)``, built on the workers.

    For benchmarks and tests that need many records without holding them on the driver.
    """

    bounded = True

    def __init__(
        self,
        count: int,
        fn: Callable[[int], Any] | None = None,
        *,
        timestamp: Callable[[int], int] | None = None,
        splits: int | None = None,
    ) -> None:
        if count < 0:
            msg = f"Generate needs a count >= 0, got {count}"
            raise ConnectorError(msg)
        self.count = count
        self.fn = fn
        self.ts_fn = timestamp
        self.splits = splits

    def describe(self) -> str:
        """One line for plans."""
        return f"generate {self.count:,} records"

    def frame(self, session: SparkSession, parallelism: int) -> DataFrame:
        """One row per split."""
        return split_frame(session, self.splits or max(1, parallelism))

    def decoder(self, source: str, with_ids: bool) -> Decoder:
        """Build the split's records."""
        count, fn, ts_fn = self.count, self.fn, self.ts_fn

        def decode(batch: pa.RecordBatch) -> Iterator[Decoded]:
            for split, splits in splits_of(batch):
                lo, hi = _bounds(count, splits, split)
                for i in range(lo, hi):
                    try:
                        value = fn(i) if fn is not None else i
                        ts = ids.check_event_time(int(ts_fn(i))) if ts_fn is not None else 0
                    except Exception as exc:  # noqa: BLE001 - user code: dead-letter it
                        rid = ids.from_position(source, "generate", 0, i) if with_ids else b""
                        error = f"{type(exc).__name__}: {exc}"
                        yield DeadLetter(rid, 0, source, error, f"index {i}", code="user_error")
                        continue
                    rid = ids.from_position(source, "generate", 0, i) if with_ids else b""
                    yield Record(rid, ts, value, "generate", i)

        return decode


def _record(
    source: str,
    split: str,
    index: int,
    value: Any,
    id_fn: Callable[[Any], Any] | None,
    ts_fn: Callable[[Any], int] | None,
    with_ids: bool,
    size: int = 0,
) -> Decoded:
    try:
        rid, ts = _id_and_ts(source, split, index, value, id_fn, ts_fn, with_ids)
    except Exception as exc:  # noqa: BLE001 - user id/timestamp functions
        rid = ids.from_position(source, split, 0, index) if with_ids else b""
        return DeadLetter(
            rid,
            0,
            source,
            f"{type(exc).__name__}: {exc}",
            f"{split}[{index}]",
            value=repr(value)[:500],
            code="user_error",
        )
    return Record(rid, ts, value, split, index, size=size)


def split_frame(session: SparkSession, splits: int) -> DataFrame:
    """Rows ``(split, splits)`` for ``split`` in ``range(splits)``, one per partition."""
    from pyspark.sql import functions as F  # noqa: N812

    return session.range(0, splits, 1, splits).withColumn("splits", F.lit(splits))


def splits_of(batch: pa.RecordBatch) -> Iterator[tuple[int, int]]:
    """The ``(split, splits)`` pairs of a batch of :func:`split_frame` rows."""
    return zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True)


def _bounds(total: int, splits: int, split: int) -> tuple[int, int]:
    return total * split // splits, total * (split + 1) // splits
