"""How much one unit of work may carry, in records and in bytes: every default in one place.

A count alone does not bound anything once records are large: 2,500 inputs of 250 KB made
one commit of 625 MB, more than Redis takes in one argument (512 MB, ``proto-max-bulk-len``;
it drops a client whose query buffer passes 1 GB), and every rerun formed the same chunk
again: a permanent stall. So every unit is cut when either bound is reached:

* a **chunk** (one atomic commit: its inputs, and the outputs, backup and state it writes,
  see :mod:`onceflow.runtime.task.chunking`): ``DedupConfig.chunk_size`` / ``chunk_bytes``;
* a **delivery** (the sink records a task holds and delivers together: one Kafka transaction,
  one pending delivery, one delivery log in Redis): ``DedupConfig.delivery_records`` /
  ``delivery_bytes``;
* an **Arrow batch** a stage hands back to Spark, and a **slice** of a source's decoded
  records: at most a chunk's bytes; Spark's own input batches to a stage, at most
  :data:`ARROW_BATCH_ROWS` / :data:`ARROW_BATCH_BYTES` (set on the session);
* a **record**: ``Pipeline(max_record_bytes=...)``. An input record, an output a function
  produces, or the outputs of one input taken together (which one commit must carry) over
  their limit are a dead letter with the reason (code ``too_large``), never a stall.

Redis runs one script at a time, so the chunk's bytes are also how long one commit blocks
everyone else. Measured with ``bench/commit_bytes.py`` (one commit carrying N MB of 250 KB
outputs, AOF ``everysec``, 2 loaded cores; how long a concurrent ``PING`` waited, medians of
two runs): 1 MB 8 ms, 2 MB 11-12 ms, 4 MB 20-63 ms, 8 MB 113-155 ms, 16 MB 165-380 ms, 64 MB
0.9-1.6 s. The knee is past a few MB: hence 4 MiB.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from operator import itemgetter
from typing import NamedTuple

from onceflow.kernel.records import Output

MiB = 1 << 20
# A record: what one input, one output or one sink record may weigh (Pipeline.max_record_bytes).
RECORD_BYTES = 1 * MiB
# A chunk: records and bytes per atomic commit (DedupConfig.chunk_size / chunk_bytes).
CHUNK_RECORDS = 2500
CHUNK_BYTES = 4 * MiB
# The largest chunk_bytes accepted: half of what Redis takes in one argument by default.
MAX_CHUNK_BYTES = 256 * MiB
MIN_BYTES = 64 * 1024  # below this a budget would cut chunks of small records by bytes
# A delivery: sink records a task holds before delivering them in one go (one transaction,
# one pending delivery and one mark in Redis). Delivering per chunk of 2,500 inputs made a
# stateless pipeline's transactional sink cost ~40 Kafka transactions and ~120 Redis calls
# per 100k records; by bytes, a transaction stays far below the producer's buffer (32 MB).
DELIVERY_RECORDS = 20_000
DELIVERY_BYTES = 16 * MiB
# Decoded source records handed on at a time (a source's Arrow batch may stand for a whole
# offset range its task reads itself); by bytes, at most a chunk's.
SOURCE_SLICE_RECORDS = 5000
# Spark's Arrow batches into a stage (spark.sql.execution.arrow.maxRecordsPerBatch and
# maxBytesPerBatch, whose default is 64 MiB).
ARROW_BATCH_ROWS = 10_000
ARROW_BATCH_BYTES = 16 * MiB
# What an output costs beside its key and value in a backup blob (MessagePack framing,
# target, ID and time): counted so that many tiny outputs are not taken for nothing.
OUTPUT_OVERHEAD = 32
_KEY, _VALUE = itemgetter(3), itemgetter(4)  # Output.key, Output.value


class Budget(NamedTuple):
    """At most ``records`` records and ``size`` bytes per unit (0: no bound on that one)."""

    records: int
    size: int

    def fits(self, records: int, size: int) -> bool:
        """Whether ``records`` records of ``size`` bytes may make one unit."""
        return (self.records <= 0 or records <= self.records) and (
            self.size <= 0 or size <= self.size
        )

    def full(self, records: int, size: int) -> bool:
        """Whether a unit holding ``records`` records of ``size`` bytes must go now."""
        return (0 < self.records <= records) or (0 < self.size <= size)


def output_bytes(out: Output) -> int:
    """What one output weighs in a backup blob, an Arrow batch or a sink record."""
    return len(out.value) + (len(out.key) if out.key is not None else 0) + OUTPUT_OVERHEAD


def outputs_bytes(outputs: Sequence[Output]) -> int:
    """What a list of outputs weighs (see :func:`output_bytes`), summed at C speed."""
    values = sum(map(len, map(_VALUE, outputs)))
    keys = sum(map(len, filter(None, map(_KEY, outputs))))
    return values + keys + OUTPUT_OVERHEAD * len(outputs)


def split_outputs(outputs: list[Output], budget: Budget) -> Iterator[list[Output]]:
    """``outputs`` in order, in runs that each fit ``budget`` (an oversized one alone)."""
    if budget.fits(len(outputs), outputs_bytes(outputs) if budget.size > 0 else 0):
        yield outputs
        return
    part: list[Output] = []
    size = 0
    for out in outputs:
        weight = output_bytes(out)
        if part and not budget.fits(len(part) + 1, size + weight):
            yield part
            part, size = [], 0
        part.append(out)
        size += weight
    if part:
        yield part
