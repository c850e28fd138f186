"""Every Redis key Onceflow writes: built here, parsed here, nowhere else.

Keys look like ``of:{<namespace>}:<kind>:...``. The braces are a Redis Cluster hash tag: all
keys of a pipeline live in one slot, so the Lua scripts that touch several of them at once
(seen-marks, backup, state, fencing) work on a cluster too. The namespace defaults to the
pipeline name; give two deployments of one pipeline different namespaces to keep them apart.

The two formulas of the layout live here too: which shard of a bucket holds a seen ID
(:func:`shard_of`), and which bucket is the oldest still deduplicated (:func:`floor_bucket`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from onceflow.kernel.errors import ConfigError

PREFIX = "of"
SCAN_ALL = "*"


class Kind(enum.Enum):
    """The kinds of keys, by the word that follows the namespace."""

    META = "meta"  # hash: settings fixed for the life of the pipeline
    EPOCH = "epoch"  # counter: fencing token of the current driver
    ACKED = "acked"  # last micro-batch Spark committed
    WATERMARK = "wm"  # largest event time committed
    ACKED_WATERMARK = "wmacked"  # the watermark when ``acked`` last moved
    GC_FLOOR = "gcfloor"  # bucket below which GC may have deleted seen-IDs
    GC = "gc"  # hash: what GC passes did
    TOKEN = "tok"  # counter per receiver partition: newest task attempt
    SEEN = "seen"  # hash per receiver, bucket and shard: ID -> owner
    FILTER_SEQ = "fseq"  # counter per receiver partition: commits covered by filters
    FILTER_JOURNAL = "fj"  # list per receiver partition: IDs of commits since the snapshot
    FILTER_SNAPSHOT = "fsnap"  # hash per receiver partition: Bloom filters by bucket
    STATS = "stats"  # hash per receiver: counters
    BACKUP = "bk"  # hash per stage, batch and partition: outputs by chunk
    STATE = "st"  # hash per combine node and partition: key -> accumulator


# Kinds whose key is just the kind word (one per namespace).
_SINGLE = frozenset(
    {
        Kind.META,
        Kind.EPOCH,
        Kind.ACKED,
        Kind.WATERMARK,
        Kind.ACKED_WATERMARK,
        Kind.GC_FLOOR,
        Kind.GC,
    }
)
# Kinds keyed by a name and a partition.
_PER_PARTITION = frozenset(
    {Kind.TOKEN, Kind.FILTER_SEQ, Kind.FILTER_JOURNAL, Kind.FILTER_SNAPSHOT, Kind.STATE}
)
_BY_WORD = {k.value: k for k in Kind}


@dataclass(frozen=True)
class ParsedKey:
    """What a key names. Fields a kind does not have are None."""

    namespace: str
    kind: Kind
    name: str | None = None  # receiver, stage or combine node
    partition: int | None = None
    bucket: int | None = None
    shard: int | None = None
    batch: int | None = None


@dataclass(frozen=True)
class Keyspace:
    """Key names of one pipeline namespace."""

    namespace: str

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in "{}\n\r :*?[]"):
            msg = (
                f"namespace {self.namespace!r} is not valid: use letters, digits, '.', '_' or "
                "'-' (no braces, spaces, ':' or glob characters)"
            )
            raise ConfigError(msg)

    @property
    def root(self) -> str:
        """Prefix of every key of the namespace."""
        return f"{PREFIX}:{{{self.namespace}}}"

    def pattern(self, kind: Kind | None = None) -> str:
        """A SCAN pattern for the namespace's keys of one kind (or all)."""
        if kind is None:
            return f"{self.root}:{SCAN_ALL}"
        if kind in _SINGLE:
            return f"{self.root}:{kind.value}"
        return f"{self.root}:{kind.value}:{SCAN_ALL}"

    def _key(self, kind: Kind, *parts: object) -> str:
        return ":".join((self.root, kind.value, *(str(p) for p in parts)))

    # pipeline-wide
    @property
    def meta(self) -> str:
        """Hash: settings fixed for the life of the pipeline (parallelism, buckets, plan)."""
        return self._key(Kind.META)

    @property
    def epoch(self) -> str:
        """Counter: fencing token of the current driver; bumped when a driver starts."""
        return self._key(Kind.EPOCH)

    @property
    def acked(self) -> str:
        """Last micro-batch Spark has committed: backups up to it are garbage."""
        return self._key(Kind.ACKED)

    @property
    def watermark(self) -> str:
        """Largest event time (ms) committed."""
        return self._key(Kind.WATERMARK)

    @property
    def acked_watermark(self) -> str:
        """The watermark when ``acked`` last moved: what the dedup floor is measured from.

        Taken from committed micro-batches only, so the floor is the same for every attempt
        of a batch (a replayed batch classifies records as late exactly as its first attempt
        did) and GC never reaches into the history an uncommitted batch may replay against.
        """
        return self._key(Kind.ACKED_WATERMARK)

    @property
    def gc_floor(self) -> str:
        """Bucket below which GC may have deleted seen-IDs; commits with an older floor fail."""
        return self._key(Kind.GC_FLOOR)

    @property
    def gc(self) -> str:
        """Hash: what the last GC pass did."""
        return self._key(Kind.GC)

    # per receiver (a stage or a sink) and partition
    def token(self, receiver: str, partition: int) -> str:
        """Counter: fencing token of the newest task attempt of a receiver partition."""
        return self._key(Kind.TOKEN, receiver, partition)

    def seen(self, receiver: str, bucket: int, shard: int) -> str:
        """Hash: ID -> owner (``batch.partition``) for one time bucket and shard."""
        return self._key(Kind.SEEN, receiver, bucket, shard)

    def seen_prefix(self, receiver: str, bucket: int) -> str:
        """Every seen-ID shard of a bucket is this prefix followed by the shard number."""
        return self._key(Kind.SEEN, receiver, bucket, "")

    def seen_pattern(self, receiver: str = SCAN_ALL) -> str:
        """SCAN pattern of seen-ID shards."""
        return self._key(Kind.SEEN, receiver, SCAN_ALL)

    def filter_seq(self, receiver: str, partition: int) -> str:
        """Counter: commits that added IDs to a receiver partition's Bloom filters."""
        return self._key(Kind.FILTER_SEQ, receiver, partition)

    def filter_journal(self, receiver: str, partition: int) -> str:
        """List: IDs of the commits since the last filter snapshot, one entry per commit."""
        return self._key(Kind.FILTER_JOURNAL, receiver, partition)

    def filter_snapshot(self, receiver: str, partition: int) -> str:
        """Hash: serialized Bloom filters per bucket, and the commit sequence they cover."""
        return self._key(Kind.FILTER_SNAPSHOT, receiver, partition)

    def stats(self, receiver: str) -> str:
        """Hash: counters of a receiver (records in, duplicates, lookups ...)."""
        return self._key(Kind.STATS, receiver)

    # per stage, batch and partition
    def backup(self, stage: str, batch: int, partition: int) -> str:
        """Hash: chunk number -> encoded outputs of one task; ``done`` when it finished."""
        return self._key(Kind.BACKUP, stage, batch, partition)

    def state(self, node: str, partition: int) -> str:
        """Hash: encoded key -> encoded accumulator of a stateful combine."""
        return self._key(Kind.STATE, node, partition)

    # parsing
    def parse(self, key: str | bytes) -> ParsedKey | None:
        """What a key of this namespace names; None for keys of other namespaces or kinds."""
        text = key.decode() if isinstance(key, bytes) else key
        if not text.startswith(self.root + ":"):
            return None
        kind_word, _, rest = text[len(self.root) + 1 :].partition(":")
        kind = _BY_WORD.get(kind_word)
        if kind is None:
            return None
        try:
            return _parse_rest(self.namespace, kind, rest)
        except ValueError:
            return None


def _parse_rest(namespace: str, kind: Kind, rest: str) -> ParsedKey | None:
    if kind in _SINGLE:
        return ParsedKey(namespace, kind) if not rest else None
    if kind is Kind.STATS:
        return ParsedKey(namespace, kind, name=rest)
    if kind in _PER_PARTITION:
        name, partition = rest.rsplit(":", 1)
        return ParsedKey(namespace, kind, name=name, partition=int(partition))
    if kind is Kind.SEEN:
        name, bucket, shard = rest.rsplit(":", 2)
        return ParsedKey(namespace, kind, name=name, bucket=int(bucket), shard=int(shard))
    name, batch, partition = rest.rsplit(":", 2)  # Kind.BACKUP
    return ParsedKey(namespace, kind, name=name, batch=int(batch), partition=int(partition))


def namespace_of_meta(key: str | bytes) -> str | None:
    """The namespace whose ``meta`` key this is (for finding every pipeline in a Redis)."""
    text = key.decode() if isinstance(key, bytes) else key
    head = f"{PREFIX}:{{"
    tail = f"}}:{Kind.META.value}"
    if text.startswith(head) and text.endswith(tail):
        return text[len(head) : -len(tail)]
    return None


META_PATTERN = f"{PREFIX}:{{*}}:{Kind.META.value}"


def shard_of(rid: bytes, shards: int) -> int:
    """The shard of a bucket that holds a seen ID: its first two bytes, modulo ``shards``.

    The vectorised form in :mod:`onceflow.dedup` must agree; a test checks both.
    """
    return ((rid[0] << 8) | rid[1]) % shards


def floor_bucket(watermark: int, horizon_ms: int, bucket_ms: int) -> int:
    """The oldest bucket still deduplicated, given the watermark the horizon is measured from.

    Records in older buckets are late (dead-lettered: a copy could no longer be recognised);
    GC deletes seen-IDs below this bucket minus its slack.
    """
    return max(0, watermark - horizon_ms) // bucket_ms
