"""How a chunk's IDs are addressed for a script: seen-ID shards referenced by KEYS index.

A script call names every key it touches in KEYS (Redis Cluster needs that); IDs travel as
one blob of 16-byte IDs with, per ID, the KEYS index of its shard in each generation that
matters as blobs of little-endian uint16: thousands of IDs are then a handful of arguments.
A uint16 index caps a call at :data:`MAX_SCRIPT_KEYS` keys; chunks are sized so that no call
comes near it (:data:`onceflow.dedup.config.MAX_CHUNK`), and :class:`KeyTable` refuses to
pass it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onceflow.dedup.config import DedupConfig
from onceflow.kernel.errors import OnceflowError
from onceflow.kernel.ids import ID_BYTES
from onceflow.kernel.keyspace import Keyspace

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
    """Seen-ID shard names and KEYS indices for one task (names cached per generation)."""

    def __init__(self, ks: Keyspace, config: DedupConfig) -> None:
        self.ks = ks
        self.config = config
        self._names: dict[tuple[str, int], list[str]] = {}

    def seen_key(self, receiver: str, generation: int, shard: int) -> str:
        """Key of a seen-ID shard (thousands are built per chunk otherwise)."""
        names = self._names.get((receiver, generation))
        if names is None:
            prefix = self.ks.seen_prefix(receiver, generation)
            names = [f"{prefix}{s}" for s in range(self.config.shards)]
            self._names[(receiver, generation)] = names
        return names[shard]

    def indices(
        self, receiver: str, generation: int, shards: np.ndarray, keys: KeyTable
    ) -> np.ndarray:
        """KEYS index of each shard's seen-ID key in one generation."""
        unique, inverse = np.unique(shards, return_inverse=True)
        index = np.array(
            [keys.add(self.seen_key(receiver, generation, int(s))) for s in unique],
            dtype=np.int64,
        )
        found: np.ndarray = index[inverse]
        return found

    def address(
        self, receiver: str, rids: list[bytes], generation: int, keys: KeyTable
    ) -> tuple[bytes, bytes]:
        """A chunk's IDs, for marking them seen in ``generation``: the IDs and shard indices."""
        if not rids:
            return b"", b""
        blob = b"".join(rids)
        raw = np.frombuffer(blob, dtype=np.uint8).reshape(-1, ID_BYTES)
        owns = self.indices(receiver, generation, shards_of(raw, self.config.shards), keys)
        return blob, owns.astype(_INDEX).tobytes()

    def lookup(
        self, receiver: str, rids: Sequence[bytes], generations: Sequence[int], keys: KeyTable
    ) -> tuple[bytes, bytes]:
        """IDs and, per ID and generation (in the given order), the shard's KEYS index."""
        blob = b"".join(rids)
        raw = np.frombuffer(blob, dtype=np.uint8).reshape(-1, ID_BYTES)
        shards = shards_of(raw, self.config.shards)
        index = np.zeros((len(rids), len(generations)), dtype=np.int64)
        for column, generation in enumerate(generations):
            index[:, column] = self.indices(receiver, generation, shards, keys)
        return blob, index.astype(_INDEX).tobytes()
