"""Rotating Bloom filters of one receiver partition, and what they are trusted to say.

One generation per time bucket, chosen by the record's bucket (never scanning them all);
within a bucket a full filter gets a successor (a fixed filter must not go past its capacity,
where its false-positive rate climbs). A filter answers "no" (certainly new) or "maybe" (ask
Redis).

The filters are pybloom-live's ``BloomFilter`` (its sizing, bit array and file format), with
one change: :class:`IdBloomFilter` addresses bits from the 128-bit record ID itself, a whole
chunk at a time with numpy, instead of hashing each key's text form in Python. Both halves of
the ID are mixed into two 64-bit hashes (so sequential or structured IDs spread as well as
random ones) and the k bit positions come from double hashing. Measured: ~0.2 µs per ID
against ~2.2 µs for ``BloomFilter.add`` on the hex form, at the configured false-positive
rate (``tests/dedup/test_bloom.py`` checks the rate).

Trust: ``seq`` is the number of commits to this receiver partition the filters cover. The
runtime compares it with Redis's commit counter before trusting a "no"; filters that are new,
restarted, or behind a commit made in another worker are first caught up from the Redis
snapshot and journal (:mod:`dedup.guard`). Filters may hold *extra* IDs (added before a commit
that then failed); that only costs a Redis lookup, never a wrong answer.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
from pybloom_live import BloomFilter

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SALT = np.uint64(0x632BE59BD9B4E019)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S3, _S7 = (np.uint64(n) for n in (30, 27, 31, 3, 7))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a cheap, well-spread 64-bit bijection."""
    x = x + _GOLDEN
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)  # type: ignore[no-any-return]


class IdBloomFilter(BloomFilter):  # type: ignore[misc]
    """A pybloom-live filter for 16-byte record IDs, checked and filled a batch at a time."""

    _view: Any = None
    _view_of: Any = None

    def _bits(self) -> np.ndarray:
        """The bit array as writable bytes (little-endian bit order, as pybloom stores it)."""
        if self._view_of is not self.bitarray:
            self._view = np.frombuffer(self.bitarray, dtype=np.uint8)
            self._view_of = self.bitarray
        return self._view  # type: ignore[no-any-return]

    def _positions(self, ids: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        raw = np.frombuffer(b"".join(ids), dtype="<u8").reshape(-1, 2)
        a, b = raw[:, 0], raw[:, 1]
        h1 = _mix(a ^ _mix(b))
        h2 = _mix(b ^ _mix(a + _SALT))
        k = np.arange(self.num_slices, dtype=np.uint64)
        bps = np.uint64(self.bits_per_slice)
        pos = (h1[:, None] + k[None, :] * h2[:, None]) % bps + k * bps
        return (pos >> _S3).astype(np.intp), (pos & _S7).astype(np.uint8)

    def contains_many(self, ids: Sequence[bytes]) -> np.ndarray:
        """For each ID: True if it may have been added ("maybe"), False if certainly not."""
        if not ids:
            return np.zeros(0, dtype=bool)
        byte, bit = self._positions(ids)
        return ((self._bits()[byte] >> bit) & 1).all(axis=1)  # type: ignore[no-any-return]

    def add_many(self, ids: Sequence[bytes]) -> np.ndarray:
        """Add IDs; return which ones may have been there before this call."""
        if not ids:
            return np.zeros(0, dtype=bool)
        byte, bit = self._positions(ids)
        view = self._bits()
        present = ((view[byte] >> bit) & 1).all(axis=1)
        np.bitwise_or.at(view, byte.ravel(), (np.uint8(1) << bit).ravel())
        self.count += len(ids)
        return present  # type: ignore[no-any-return]

    def add(self, key: bytes, skip_check: bool = False) -> bool:
        """One ID (same addressing as the batch methods)."""
        return bool(self.add_many([key])[0])

    def __contains__(self, key: bytes) -> bool:
        return bool(self.contains_many([key])[0])

    @property
    def room(self) -> int:
        """IDs it can still take before its false-positive rate would exceed the target."""
        return max(0, int(self.capacity) - int(self.count))


class ReceiverFilters:
    """Bloom generations by bucket for one receiver partition."""

    def __init__(self, capacity: int, error_rate: float) -> None:
        self.capacity = capacity
        self.error_rate = error_rate
        self.buckets: dict[int, list[IdBloomFilter]] = {}
        self.seq = 0
        self.dirty: set[int] = set()

    def _chain(self, bucket: int) -> list[IdBloomFilter]:
        chain = self.buckets.get(bucket)
        if chain is None:
            chain = [IdBloomFilter(self.capacity, self.error_rate)]
            self.buckets[bucket] = chain
        return chain

    def check_and_add(
        self, ids: Sequence[bytes], buckets: Sequence[int], neighbours: Sequence[int | None]
    ) -> list[bool]:
        """Add each ID to its bucket; True ("maybe") where it may have been seen already.

        An ID near a bucket edge is also looked up (not added) in the neighbouring bucket.
        """
        maybe = [False] * len(ids)
        groups: dict[int, list[int]] = {}
        for i, b in enumerate(buckets):
            groups.setdefault(b, []).append(i)
        for bucket, rows in groups.items():
            found = self._add_to_bucket(bucket, [ids[i] for i in rows])
            for i, f in zip(rows, found, strict=True):
                maybe[i] = f
        near: dict[int, list[int]] = {}
        for i, n in enumerate(neighbours):
            if n is not None and not maybe[i]:
                near.setdefault(n, []).append(i)
        for bucket, rows in near.items():
            for f in self.buckets.get(bucket, ()):
                hits = f.contains_many([ids[i] for i in rows])
                for i, hit in zip(rows, hits, strict=True):
                    maybe[i] = maybe[i] or bool(hit)
        return maybe

    def _add_to_bucket(self, bucket: int, ids: list[bytes]) -> list[bool]:
        chain = self._chain(bucket)
        found = np.zeros(len(ids), dtype=bool)
        # Every generation is asked before anything is added: an ID held by the current last
        # filter may be added to a successor below, which knows nothing of it.
        for f in chain:
            found |= f.contains_many(ids)
        # Only IDs no generation knows are added: a "maybe" stays a maybe forever (its bits
        # never clear), so adding it again would only use up capacity.
        todo = np.flatnonzero(~found)
        start = 0
        while start < len(todo):
            last = chain[-1]
            if last.room == 0:
                last = IdBloomFilter(self.capacity, self.error_rate)
                chain.append(last)
            part = todo[start : start + last.room]
            found[part] |= last.add_many([ids[i] for i in part])  # repeats within the call
            start += len(part)
        self.dirty.add(bucket)
        return [bool(x) for x in found]

    def add(self, ids: Sequence[bytes], buckets: Sequence[int]) -> None:
        """Add without asking (catching up from the journal)."""
        groups: dict[int, list[bytes]] = {}
        for rid, b in zip(ids, buckets, strict=True):
            groups.setdefault(b, []).append(rid)
        for bucket, group in groups.items():
            self._add_to_bucket(bucket, group)

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
        """One generation, serialized (pybloom's own format, not pickle), zlib-compressed.

        A filter is sized for its capacity but most buckets hold far fewer IDs: the sparse
        bit array compresses to a few percent (measured: the snapshots of a pipeline with
        ~1,000 IDs per bucket shrank ~20x), and a full one costs ~1 ms to compress.
        """
        blobs = []
        for f in self.buckets.get(bucket, ()):
            buf = io.BytesIO()
            f.tofile(buf)
            blobs.append(zlib.compress(buf.getvalue(), 1))
        return msgpack.packb(blobs, use_bin_type=True)  # type: ignore[no-any-return]

    def load_bucket(self, bucket: int, data: bytes) -> None:
        """Replace one generation with a serialized one."""
        chain = []
        for packed in msgpack.unpackb(data, raw=False):
            blob = zlib.decompress(packed)
            chain.append(IdBloomFilter.fromfile(io.BytesIO(blob), len(blob)))
        if chain:
            self.buckets[bucket] = chain
