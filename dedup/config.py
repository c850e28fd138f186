"""Dedup settings: the horizon, generations, Bloom filter sizing, Redis layout."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from onceflow.dedup.errors import DedupConfigError
from onceflow.kernel.durations import DAY_MS, Duration, parse_duration_ms
from onceflow.kernel.keyspace import floor_bucket
from onceflow.kernel.limits import (
    CHUNK_BYTES,
    CHUNK_RECORDS,
    DELIVERY_BYTES,
    DELIVERY_RECORDS,
    MAX_CHUNK_BYTES,
    MIN_BYTES,
    Budget,
)

# A commit names every seen-ID shard it touches in one script call, whose KEYS are indexed by
# uint16 (see onceflow.dedup.addressing): this cap keeps a call far below that.
MAX_CHUNK = 20_000
MAX_SHARDS = 65_536
MIN_BLOOM_CAPACITY = 100
# Generations a horizon is cut into by default: each live generation is one more Bloom
# filter an ID is checked against, and the oldest is kept up to a generation past the horizon.
DEFAULT_GENERATIONS = 8
# Generations beside the horizon's own: the current one and GC's slack.
EXTRA_GENERATIONS = 2


@dataclass(frozen=True)
class DedupConfig:
    """How receivers remember IDs.

    ``horizon_ms``: how long a copy of a record is still recognised: a copy that arrives while
    the pipeline's watermark has moved less than this since the original was committed is
    dropped, whatever timestamp the copy carries. A record whose event time is older than the
    watermark minus the horizon could be a copy of one already forgotten, so it is
    dead-lettered as late rather than risk a duplicate. Older state is garbage for GC.
    ``bucket_ms``: the granularity of that memory: seen-IDs are kept per generation (the
    bucket of the watermark when they were committed), each generation one set of Redis
    hashes and one Bloom filter chain; a copy is checked against every live generation.
    Default: the horizon in 8 generations.
    ``bloom_capacity``/``bloom_error``: size of each Bloom filter, and the false-positive rate
    of a lookup across all live generations (each filter gets its share); a full filter gets
    a successor in the same generation.
    ``shards``: seen-IDs of a generation are spread over this many small Redis hashes, which
    Redis keeps in its compact listpack encoding (~21 bytes per seen ID,
    instead of ~110 for a key each) while each holds at most ``hash-max-listpack-entries``
    IDs; past that a hash costs ~80 bytes per ID: give a generation's IDs enough shards (see
    ``docs/concepts/dedup.md``). A receiver kept per partition scope (a keyed stage) shares
    them and the Bloom capacity out: each partition has ``1 / parallelism`` of both
    (:meth:`for_scope`).
    ``chunk_size``: records per atomic commit. Larger chunks amortize per-call work (2,500 ran
    ~10% faster than 1,000; more gained nothing) but a call holds Redis longer (~10 ms).
    ``chunk_bytes``: bytes per atomic commit, of the chunk's inputs and, again, of what it
    writes (outputs, backup, state): a chunk is cut when either bound is reached. Redis runs
    one script at a time, so this is also how long a commit holds everyone else up (4 MiB
    ~20-60 ms; 64 MiB ~1-1.6 s; see :mod:`onceflow.kernel.limits`). One input's outputs over
    it are a dead letter (``too_large``).
    ``delivery_records``/``delivery_bytes``: sink records a task holds and delivers in one
    go (one Kafka transaction, one pending delivery, one delivery log in Redis).
    ``snapshot_every``: commits between Bloom snapshots (filters that moved replay the journal
    of commits since the last snapshot).
    """

    bucket_ms: int = DAY_MS // DEFAULT_GENERATIONS
    horizon_ms: int = DAY_MS
    bloom_capacity: int = 100_000
    bloom_error: float = 0.001
    shards: int = 1024
    chunk_size: int = CHUNK_RECORDS
    snapshot_every: int = 32
    chunk_bytes: int = CHUNK_BYTES
    delivery_records: int = DELIVERY_RECORDS
    delivery_bytes: int = DELIVERY_BYTES

    def for_scope(self, parallelism: int) -> DedupConfig:
        """The settings of one partition scope: its share of the shards and filter capacity.

        A receiver kept per partition sees ``1 / parallelism`` of the IDs, so its seen-ID
        hashes stay as dense as an unscoped receiver's and its Bloom filters as full.
        """
        share = max(1, parallelism)
        return replace(
            self,
            shards=max(1, self.shards // share),
            bloom_capacity=max(MIN_BLOOM_CAPACITY, self.bloom_capacity // share),
        )

    def __post_init__(self) -> None:
        problems = []
        if self.bucket_ms <= 0:
            problems.append(f"bucket_ms must be positive, got {self.bucket_ms}")
        if self.horizon_ms < self.bucket_ms:
            problems.append(
                f"horizon_ms ({self.horizon_ms}) must be >= bucket_ms ({self.bucket_ms})"
            )
        if not 0 < self.bloom_error < 1:
            problems.append(f"bloom_error must be in (0, 1), got {self.bloom_error}")
        if self.bloom_capacity < MIN_BLOOM_CAPACITY:
            problems.append(
                f"bloom_capacity must be >= {MIN_BLOOM_CAPACITY}, got {self.bloom_capacity}"
            )
        if not 1 <= self.shards <= MAX_SHARDS:
            problems.append(f"shards must be in [1, {MAX_SHARDS}], got {self.shards}")
        if not 1 <= self.chunk_size <= MAX_CHUNK:
            problems.append(f"chunk_size must be in [1, {MAX_CHUNK}], got {self.chunk_size}")
        if self.snapshot_every < 1:
            problems.append(f"snapshot_every must be >= 1, got {self.snapshot_every}")
        problems += _byte_problems(self)
        if problems:
            raise DedupConfigError("invalid dedup settings: " + "; ".join(problems))

    @classmethod
    def of(
        cls, horizon: Duration = "24h", bucket: Duration | None = None, **more: Any
    ) -> DedupConfig:
        """Settings from durations: ``DedupConfig.of(horizon="7d", bucket="12h")``.

        A bare number is seconds (``horizon=3600`` is an hour), as everywhere in the API.
        """
        horizon_ms = parse_duration_ms(horizon, "horizon")
        bucket_ms = (
            parse_duration_ms(bucket, "bucket")
            if bucket is not None
            else max(1, horizon_ms // DEFAULT_GENERATIONS)
        )
        return cls(bucket_ms=bucket_ms, horizon_ms=horizon_ms, **more)

    def bucket(self, ts: int) -> int:
        """The bucket of an event time (or of a watermark: its generation)."""
        return ts // self.bucket_ms

    def floor(self, watermark: int, horizon_ms: int | None = None) -> int:
        """Oldest bucket still deduplicated, given the watermark the horizon is measured from."""
        return floor_bucket(
            watermark, self.horizon_ms if horizon_ms is None else horizon_ms, self.bucket_ms
        )

    @property
    def delivery(self) -> Budget:
        """What one delivery to a sink may hold."""
        return Budget(self.delivery_records, self.delivery_bytes)

    @property
    def live_generations(self) -> int:
        """How many generations an ID is checked against, at most."""
        return -(-self.horizon_ms // self.bucket_ms) + EXTRA_GENERATIONS

    @property
    def filter_error(self) -> float:
        """Each filter's false-positive rate, so a check across every live one meets the target."""
        return self.bloom_error / self.live_generations


def _byte_problems(config: DedupConfig) -> list[str]:
    """What is wrong with the byte budgets (an empty list: nothing)."""
    problems = []
    if not MIN_BYTES <= config.chunk_bytes <= MAX_CHUNK_BYTES:
        problems.append(
            f"chunk_bytes must be in [{MIN_BYTES}, {MAX_CHUNK_BYTES}] (Redis refuses one "
            f"argument over 512 MB by default), got {config.chunk_bytes}"
        )
    if config.delivery_records < 1:
        problems.append(f"delivery_records must be >= 1, got {config.delivery_records}")
    if config.delivery_bytes < MIN_BYTES:
        problems.append(f"delivery_bytes must be >= {MIN_BYTES}, got {config.delivery_bytes}")
    return problems
