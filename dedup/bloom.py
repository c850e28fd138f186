"""Rotating Bloom filters of one receiver partition, and what they are trusted to say.

One generation per time bucket, chosen by the record's bucket (never scanning them all);
within a bucket a full filter gets a successor (pybloom-live's fixed filters fail past their
capacity). A filter answers "no" (certainly new) or "maybe" (ask Redis).

Trust: ``seq`` is the number of commits to this receiver partition the filters cover. The
runtime compares it with Redis's commit counter before trusting a "no"; a filter that is new,
was restarted, or saw a commit made by another worker is first caught up from the Redis
snapshot and journal (:mod:`dedup.guard`). Filters may hold *extra* IDs (added before a commit
that then failed); that only costs a Redis lookup, never a wrong answer.
"""

from __future__ import annotations

import io

import msgpack
from pybloom_live import BloomFilter


class ReceiverFilters:
    """Bloom generations by bucket for one receiver partition."""

    def __init__(self, capacity: int, error_rate: float) -> None:
        self.capacity = capacity
        self.error_rate = error_rate
        self.buckets: dict[int, list[BloomFilter]] = {}
        self.seq = 0
        self.dirty: set[int] = set()

    def _chain(self, bucket: int) -> list[BloomFilter]:
        chain = self.buckets.get(bucket)
        if chain is None:
            chain = [BloomFilter(self.capacity, self.error_rate)]
            self.buckets[bucket] = chain
        return chain

    def check_and_add(self, key: str, bucket: int, neighbour: int | None = None) -> bool:
        """Add ``key`` to its bucket; True ("maybe") if it may have been there already."""
        chain = self._chain(bucket)
        maybe = any(key in f for f in chain[:-1])
        last = chain[-1]
        if last.count >= last.capacity:
            last = BloomFilter(self.capacity, self.error_rate)
            chain.append(last)
        if last.add(key):
            maybe = True
        self.dirty.add(bucket)
        if not maybe and neighbour is not None:
            maybe = any(key in f for f in self.buckets.get(neighbour, ()))
        return maybe

    def add(self, key: str, bucket: int) -> None:
        """Add without asking (catching up from the journal)."""
        chain = self._chain(bucket)
        last = chain[-1]
        if last.count >= last.capacity:
            last = BloomFilter(self.capacity, self.error_rate)
            chain.append(last)
        last.add(key, skip_check=True)
        self.dirty.add(bucket)

    def drop_before(self, bucket: int) -> list[int]:
        """Forget generations older than ``bucket``; return the dropped buckets."""
        old = [b for b in self.buckets if b < bucket]
        for b in old:
            del self.buckets[b]
            self.dirty.discard(b)
        return old

    def memory_bytes(self) -> int:
        """Bytes held by the bit arrays."""
        return sum(f.num_bits // 8 for chain in self.buckets.values() for f in chain)

    def dump_bucket(self, bucket: int) -> bytes:
        """One generation, serialized (pybloom's own compact format, not pickle)."""
        blobs = []
        for f in self.buckets.get(bucket, ()):
            buf = io.BytesIO()
            f.tofile(buf)
            blobs.append(buf.getvalue())
        return msgpack.packb(blobs, use_bin_type=True)  # type: ignore[no-any-return]

    def load_bucket(self, bucket: int, data: bytes) -> None:
        """Replace one generation with a serialized one."""
        chain = []
        for blob in msgpack.unpackb(data, raw=False):
            f = BloomFilter.fromfile(io.BytesIO(blob), len(blob))
            chain.append(f)
        if chain:
            self.buckets[bucket] = chain


def id_key(rid: bytes) -> str:
    """The form of an ID given to pybloom-live (it hashes text; hex is stable and cheap)."""
    return rid.hex()
