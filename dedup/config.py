"""Dedup settings: time buckets, the horizon, Bloom filter sizing, Redis layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onceflow.dedup.errors import DedupConfigError
from onceflow.kernel.durations import HOUR_MS, MINUTE_MS, parse_duration_ms
from onceflow.kernel.keyspace import floor_bucket

# A commit names every seen-ID shard it touches (up to two per ID) in one script call, whose
# KEYS are indexed by uint16 (see onceflow.dedup.addressing): this cap keeps a call far below.
MAX_CHUNK = 20_000
MAX_SHARDS = 65_536


@dataclass(frozen=True)
class DedupConfig:
    """How receivers remember IDs.

    ``bucket_ms``: seen-IDs and Bloom generations are kept per bucket of event time.
    ``horizon_ms``: how far back (from the newest committed event time) a duplicate is still
    recognised; older buckets are garbage, and a record older than the horizon cannot be
    deduplicated, so it is dead-lettered rather than risk a duplicate.
    ``skew_ms``: copies of one record whose event times differ by up to this much are still
    recognised (a record near a bucket edge is also checked in the neighbouring bucket).
    ``bloom_capacity``/``bloom_error``: size of each Bloom filter; a full filter gets a
    successor in the same bucket (rotation by count as well as by time).
    ``shards``: seen-IDs of a bucket are spread over this many small Redis hashes, which Redis
    keeps in its compact listpack encoding (~20 bytes per ID instead of ~110 for a key each).
    ``chunk_size``: records per atomic commit. Larger chunks amortize per-call work (2,500 ran
    ~10% faster than 1,000; more gained nothing) but a call holds Redis longer (~10 ms).
    ``snapshot_every``: commits between Bloom snapshots (a moved filter replays the journal of
    commits since the last snapshot).
    """

    bucket_ms: int = HOUR_MS
    horizon_ms: int = 24 * HOUR_MS
    skew_ms: int = 5 * MINUTE_MS
    bloom_capacity: int = 100_000
    bloom_error: float = 0.001
    shards: int = 1024
    chunk_size: int = 2500
    snapshot_every: int = 8

    def __post_init__(self) -> None:
        problems = []
        if self.bucket_ms <= 0:
            problems.append(f"bucket_ms must be positive, got {self.bucket_ms}")
        if self.horizon_ms < self.bucket_ms:
            problems.append(
                f"horizon_ms ({self.horizon_ms}) must be >= bucket_ms ({self.bucket_ms})"
            )
        if not 0 <= self.skew_ms < self.bucket_ms // 2:
            problems.append(f"skew_ms must be in [0, bucket_ms/2), got {self.skew_ms}")
        if not 0 < self.bloom_error < 1:
            problems.append(f"bloom_error must be in (0, 1), got {self.bloom_error}")
        if self.bloom_capacity < 100:
            problems.append(f"bloom_capacity must be >= 100, got {self.bloom_capacity}")
        if not 1 <= self.shards <= MAX_SHARDS:
            problems.append(f"shards must be in [1, {MAX_SHARDS}], got {self.shards}")
        if not 1 <= self.chunk_size <= MAX_CHUNK:
            problems.append(f"chunk_size must be in [1, {MAX_CHUNK}], got {self.chunk_size}")
        if problems:
            raise DedupConfigError("invalid dedup settings: " + "; ".join(problems))

    @classmethod
    def of(cls, horizon: str | int = "24h", bucket: str | int = "1h", **more: Any) -> DedupConfig:
        """Settings from durations: ``DedupConfig.of(horizon="7d", bucket="6h")``."""
        bucket_ms = parse_duration_ms(bucket)
        more.setdefault("skew_ms", min(cls.skew_ms, bucket_ms // 10))
        return cls(bucket_ms=bucket_ms, horizon_ms=parse_duration_ms(horizon), **more)

    def bucket(self, ts: int) -> int:
        """The bucket of an event time."""
        return ts // self.bucket_ms

    def neighbour(self, ts: int) -> int | None:
        """The adjacent bucket a copy of this record may have landed in, if any."""
        offset = ts % self.bucket_ms
        if offset < self.skew_ms:
            return ts // self.bucket_ms - 1
        if self.bucket_ms - offset <= self.skew_ms:
            return ts // self.bucket_ms + 1
        return None

    def floor(self, watermark: int) -> int:
        """Oldest bucket still deduplicated, given the watermark the horizon is measured from."""
        return floor_bucket(watermark, self.horizon_ms, self.bucket_ms)
