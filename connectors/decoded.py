"""What a source's decoder hands the executor: records, one by one or a lane's as columns.

Part of the connector contract (:mod:`onceflow.connectors.base` names them too): a
:class:`Decoder` turns an Arrow batch of a source's raw rows into :data:`Decoded` items.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onceflow.kernel.records import DeadLetter, Record

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass(frozen=True)
class LaneProgress:
    """A source lane's event time has reached ``ts`` though no record says so (a heartbeat).

    A decoder yields it to move the watermark without a record (the testing module's
    ``TestStream.advance_watermark`` does). The lane is raised as a record of that event time
    would raise it, but never past the micro-batch's own time; bounded runs ignore it.
    """

    lane: str
    ts: int


@dataclass(frozen=True)
class RecordColumns:
    """Records of one source lane decoded together, as columns.

    What ``n`` :class:`Record` objects of that lane would say, field by field, in the same
    order (index ``i`` of every list is record ``i``).

    The source's hot path: a slice of a partition becomes a handful of lists built by list
    comprehensions, never an object (or a generator step) per record. ``positional``,
    ``sizes`` and ``fingerprints`` mean what :class:`Record`'s fields of the same names mean.
    """

    lane: str
    ids: list[bytes]
    ts: list[int]
    elems: list[Any]
    offsets: list[int]
    positional: list[bool]
    sizes: list[int]
    fingerprints: list[int]

    def __len__(self) -> int:
        return len(self.ids)

    def records(self) -> Iterator[Record]:
        """The same records one by one (what a slow path, or a test, reads)."""
        lane = self.lane
        for rid, ts, elem, offset, positional, size, printed in zip(
            self.ids,
            self.ts,
            self.elems,
            self.offsets,
            self.positional,
            self.sizes,
            self.fingerprints,
            strict=True,
        ):
            yield Record(rid, ts, elem, lane, offset, positional, size, printed)


Decoded = Record | DeadLetter | LaneProgress | RecordColumns
Decoder = Callable[["pa.RecordBatch"], Iterator[Decoded]]
