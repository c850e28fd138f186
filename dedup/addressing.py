"""How a chunk's IDs are addressed for a script: seen-ID shards referenced by KEYS index.

A script call names every key it touches in KEYS (Redis Cluster needs that); IDs travel as
one blob of 16-byte IDs with, per ID, the KEYS index of its shard (and of its neighbour-bucket
shard, or 0) as blobs of little-endian uint16: thousands of IDs are then a handful of
arguments. A uint16 index caps a call at :data:`MAX_SCRIPT_KEYS` keys; chunks are sized so
that no call comes near it (:data:`onceflow.dedup.config.MAX_CHUNK`), and
:class:`KeyTable` refuses to pass it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onceflow.dedup.config import DedupConfig
from onceflow.dedup.trust import journal_entry
from onceflow.kernel.errors import OnceflowError
from onceflow.kernel.ids import ID_BYTES
from onceflow.kernel.keyspace import Keyspace, shard_of

MAX_SCRIPT_KEYS = 0xFFFF  # KEYS indices travel as uint16
_INDEX = "<u2"


class KeyTable:
    """The KEYS of one script call, each once, in order; an index per key (1-based)."""

    def __init__(self, fixed: Sequence[str] = ()) -> None:
        self.index: dict[str, int] = {}
        for key in fixed:
            self.add(key)

    def add(self, key: str) -> int:
        """The key's index, adding it if new."""
        found = self.index.get(key)
        if found is not None:
            return found
        if len(self.index) >= MAX_SCRIPT_KEYS:
            msg = (
                f"a script call would touch more than {MAX_SCRIPT_KEYS} keys; this is a bug "
                "(chunks are sized to stay far below it)"
            )
            raise OnceflowError(msg)
        n = len(self.index) + 1
        self.index[key] = n
        return n

    @property
    def keys(self) -> list[str]:
        """KEYS in index order."""
        return list(self.index)


def shards_of(raw: np.ndarray, shards: int) -> np.ndarray:
    """:func:`onceflow.kernel.keyspace.shard_of` for a ``(n, 16)`` uint8 array of IDs."""
    shard: np.ndarray = ((raw[:, 0].astype(np.int64) << 8) | raw[:, 1]) % shards
    return shard


class Addressing:
    """Seen-ID shard names and KEYS indices for one task (names cached per bucket)."""

    def __init__(self, ks: Keyspace, config: DedupConfig) -> None:
        self.ks = ks
        self.config = config
        self._names: dict[tuple[str, int], list[str]] = {}

    def seen_key(self, receiver: str, bucket: int, shard: int) -> str:
        """Key of a seen-ID shard (thousands are built per chunk otherwise)."""
        names = self._names.get((receiver, bucket))
        if names is None:
            prefix = self.ks.seen_prefix(receiver, bucket)
            names = [f"{prefix}{s}" for s in range(self.config.shards)]
            self._names[(receiver, bucket)] = names
        return names[shard]

    def neighbour(self, ts: int, floor: int) -> int | None:
        """The adjacent bucket a copy may have landed in, if it is still deduplicated."""
        n = self.config.neighbour(ts)
        return n if n is not None and n >= floor else None

    def indices(
        self, receiver: str, buckets: np.ndarray, shards: np.ndarray, keys: KeyTable
    ) -> np.ndarray:
        """KEYS index of each (bucket, shard) pair's seen-ID key."""
        codes = buckets * 65536 + shards
        unique, inverse = np.unique(codes, return_inverse=True)
        index = np.array(
            [keys.add(self.seen_key(receiver, int(c) >> 16, int(c) & 0xFFFF)) for c in unique],
            dtype=np.int64,
        )
        return index[inverse]

    def address(
        self,
        receiver: str,
        rids: list[bytes],
        tss: list[int],
        keys: KeyTable,
        floor: int,
        near: bool,
    ) -> tuple[bytes, bytes, bytes, bytes]:
        """A chunk's IDs, addressed for a script.

        Returns the IDs blob, their shard indices, their neighbour-bucket shard indices (empty
        when no ID is near a bucket edge, or ``near`` is False) and the journal entry.
        """
        cfg = self.config
        if not rids:
            return b"", b"", b"", journal_entry([])
        blob = b"".join(rids)
        raw = np.frombuffer(blob, dtype=np.uint8).reshape(-1, ID_BYTES)
        shards = shards_of(raw, cfg.shards)
        ts = np.asarray(tss, dtype=np.int64)
        buckets = ts // cfg.bucket_ms
        owns = self.indices(receiver, buckets, shards, keys)
        alts = b""
        if near:
            offset = ts - buckets * cfg.bucket_ms
            low, high = offset < cfg.skew_ms, (cfg.bucket_ms - offset) <= cfg.skew_ms
            if low.any() or high.any():
                alt_bucket = np.where(low, buckets - 1, buckets + 1)
                valid = (low | high) & (alt_bucket >= floor)
                index = np.zeros(len(rids), dtype=np.int64)
                if valid.any():
                    index[valid] = self.indices(receiver, alt_bucket[valid], shards[valid], keys)
                alts = index.astype(_INDEX).tobytes()
        journal = journal_entry(
            [
                (int(b), b"".join(rids[i] for i in np.flatnonzero(buckets == b)))
                for b in np.unique(buckets)
            ]
        )
        return blob, owns.astype(_INDEX).tobytes(), alts, journal

    def lookup_args(
        self, receiver: str, items: Sequence[tuple[bytes, int]], keys: KeyTable, floor: int
    ) -> list[object]:
        """Arguments of the lookup script: ``n, (id, own index, neighbour index or 0) x n``."""
        cfg = self.config
        args: list[object] = [len(items)]
        for rid, ts in items:
            shard = shard_of(rid, cfg.shards)
            own = keys.add(self.seen_key(receiver, ts // cfg.bucket_ms, shard))
            neighbour = self.neighbour(ts, floor)
            alt = 0 if neighbour is None else keys.add(self.seen_key(receiver, neighbour, shard))
            args += [rid, own, alt]
        return args
