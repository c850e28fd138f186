"""Every Redis key Onceflow writes: built here, parsed here, nowhere else.

Keys look like ``of:{<namespace>}:<kind>:...``. The braces are a Redis Cluster hash tag: the
keys inside one tag live in one slot, so the Lua scripts that touch several of them at once
(seen-marks, backup, state, fencing) work on a cluster too. The namespace defaults to the
pipeline name; give two deployments of one pipeline different namespaces to keep them apart.

A stage that follows a key exchange keeps each partition's keys under a tag of their own,
``of:{<namespace>:<scope>}:...`` (a *partition scope*, see :mod:`onceflow.kernel.scopes`), so
a pipeline's state spreads over a cluster's masters. Inside a scope the key names are the same
as in the namespace's own tag; ``epoch`` there is a copy of the driver epoch (each driver
sets it when it starts), and ``gens`` the generations the partition committed into.

Time is cut into buckets of ``bucket_ms``. A micro-batch marks the IDs it commits as seen in
its *generation*: the bucket of the pipeline's dedup time when the batch started (fixed in the
batch's parameters, ``batch:<n>``; see :mod:`onceflow.dedup.batch`). ``gens`` remembers the
newest event time committed into each generation, which decides how long it is kept; which
bucket is the oldest still deduplicated is :func:`floor_bucket`.

How a seen ID is stored in its shard (the seen-ID *layout*: which shard holds it, its field
there and its mark) is :mod:`onceflow.kernel.seen_layout`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from onceflow.kernel.errors import ConfigError

PREFIX = "of"
SCAN_ALL = "*"
# Characters a namespace or a scope cannot hold: hash-tag braces, separators, glob characters.
_NOT_IN_NAMES = "{}\n\r :*?[]"


def glob_escape(text: str) -> str:
    """``text`` for a Redis SCAN/KEYS pattern that matches it literally."""
    return "".join("\\" + c if c in "\\*?[]" else c for c in text)


class Kind(enum.Enum):
    """The kinds of keys, by the word that follows the namespace."""

    META = "meta"  # hash: settings fixed for the life of the pipeline
    EPOCH = "epoch"  # counter: fencing token of the current driver
    ACKED = "acked"  # last micro-batch Spark committed
    CLOCK = "clock"  # hash: the newest batch's watermark, dedup time and wall-clock time
    LANES = "lanes"  # hash: source partition -> largest event time committed
    LANE_ACTIVITY = "lanesat"  # hash: source partition -> batch time it last had records
    BATCH = "batch"  # hash per micro-batch: its parameters, fixed by its first attempt
    GENERATIONS = "gens"  # hash: generation -> the newest event time committed into it
    GC = "gc"  # hash: what GC passes did
    TOKEN = "tok"  # per stage partition: the task attempt that owns it
    SEEN = "seen"  # hash per receiver, generation and shard: seen IDs (see the layout)
    FILTER_SEQ = "fseq"  # counter per receiver: commits covered by Bloom filters
    FILTER_JOURNAL = "fj"  # list per receiver: IDs of the commits since the snapshot
    FILTER_SNAPSHOT = "fsnap"  # hash per receiver: Bloom filters by generation
    STATS = "stats"  # hash per receiver: counters
    BACKUP = "bk"  # hash per stage, batch and partition: outputs by chunk
    STATE = "st"  # hash per combine node and partition: key -> accumulator (or windows)
    EVENT_TIMERS = "tm"  # sorted set per windowed node and partition: key -> next event time
    PROCESSING_TIMERS = "ptm"  # sorted set, the same: key -> when an early pane is due
    EXPIRY = "exp"  # sorted set per node with a ttl and partition: key -> when its state ends
    PENDING = "pend"  # hash per sink receiver and partition: a delivery not yet marked
    DRIVER = "driver"  # string with a time-to-live: the running driver (host, pid, epoch)
    REDRIVE = "redrive"  # hash: dead letters replayed so far (code:partition -> next offset)
    RESCALE = "rescale"  # string with a time-to-live: the rescale under way (host, pid)


# Kinds whose key is just the kind word (one per namespace).
_SINGLE = frozenset(
    {
        Kind.META,
        Kind.EPOCH,
        Kind.ACKED,
        Kind.CLOCK,
        Kind.LANES,
        Kind.LANE_ACTIVITY,
        Kind.GENERATIONS,
        Kind.GC,
        Kind.DRIVER,
        Kind.REDRIVE,
        Kind.RESCALE,
    }
)
# Kinds keyed by a name only.
_PER_NAME = frozenset({Kind.STATS, Kind.FILTER_SEQ, Kind.FILTER_JOURNAL, Kind.FILTER_SNAPSHOT})
# Kinds keyed by a name and a partition.
_PER_PARTITION = frozenset(
    {
        Kind.TOKEN,
        Kind.STATE,
        Kind.PENDING,
        Kind.EVENT_TIMERS,
        Kind.PROCESSING_TIMERS,
        Kind.EXPIRY,
    }
)
# The sorted set of each timer kind a stateful combine writes (see StateWrite.timers).
TIMER_KINDS = {
    "event": Kind.EVENT_TIMERS,
    "processing": Kind.PROCESSING_TIMERS,
    "expiry": Kind.EXPIRY,
}
_BY_WORD = {k.value: k for k in Kind}


@dataclass(frozen=True)
class ParsedKey:
    """What a key names. Fields a kind does not have are None."""

    namespace: str
    kind: Kind
    name: str | None = None  # receiver, stage or combine node
    partition: int | None = None
    generation: int | None = None
    shard: int | None = None
    batch: int | None = None


@dataclass(frozen=True)
class Keyspace:
    """Key names of one pipeline namespace."""

    namespace: str
    scope: str | None = None  # a partition scope (its own hash tag), or the namespace's tag

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in _NOT_IN_NAMES):
            msg = (
                f"namespace {self.namespace!r} is not valid: use letters, digits, '.', '_' or "
                "'-' (no braces, spaces, ':' or glob characters)"
            )
            raise ConfigError(msg)
        if self.scope is not None and (
            not self.scope or any(c in self.scope for c in _NOT_IN_NAMES)
        ):
            msg = f"partition scope {self.scope!r} is not valid; this is an Onceflow bug"
            raise ConfigError(msg)

    @property
    def tag(self) -> str:
        """The hash tag of these keys: the namespace, or ``<namespace>:<scope>``."""
        return self.namespace if self.scope is None else f"{self.namespace}:{self.scope}"

    @property
    def root(self) -> str:
        """Prefix of every key of the namespace (or of the partition scope)."""
        return f"{PREFIX}:{{{self.tag}}}"

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
    def clock(self) -> str:
        """Hash: the newest batch's ``watermark``, ``dedup_time`` and ``time`` (all ms)."""
        return self._key(Kind.CLOCK)

    @property
    def lanes(self) -> str:
        """Hash: source partition (lane) -> the largest event time it committed."""
        return self._key(Kind.LANES)

    @property
    def lane_activity(self) -> str:
        """Hash: lane -> the batch time of the last micro-batch that had records from it."""
        return self._key(Kind.LANE_ACTIVITY)

    def batch(self, batch: int) -> str:
        """Hash: a micro-batch's parameters (time, watermark, floors, generation, horizon).

        Set by the first attempt of the batch, read by every later one, so a replayed batch
        classifies and places records exactly as its first attempt did.
        """
        return self._key(Kind.BATCH, batch)

    @property
    def generations(self) -> str:
        """Hash: generation -> the newest event time of the records committed into it.

        A generation is looked up while that time is within the horizon of the watermark,
        and is garbage after: a copy of any of its records would be late.
        """
        return self._key(Kind.GENERATIONS)

    @property
    def driver(self) -> str:
        """The running driver, refreshed while it runs (it ends by itself when it does not)."""
        return self._key(Kind.DRIVER)

    @property
    def rescale(self) -> str:
        """The rescale under way, with a time-to-live (see ``runtime.driver.rescale_checks``)."""
        return self._key(Kind.RESCALE)

    @property
    def redrive(self) -> str:
        """Hash: how far ``onceflow dead-letters replay`` has replayed each code, per partition."""
        return self._key(Kind.REDRIVE)

    @property
    def gc(self) -> str:
        """Hash: what the last GC pass did, and how far GC has ever deleted (GC_FLOOR_FIELD)."""
        return self._key(Kind.GC)

    # per stage partition
    def token(self, stage: str, partition: int) -> str:
        """The task attempt that owns a stage partition (driver epoch, attempt number)."""
        return self._key(Kind.TOKEN, stage, partition)

    # per receiver (a stage or a sink)
    def seen(self, receiver: str, generation: int, shard: int) -> str:
        """Hash: the seen-IDs of one generation and shard, their fields -> marks.

        Fields, marks and the shard of an ID: see :mod:`onceflow.kernel.seen_layout`.
        """
        return self._key(Kind.SEEN, receiver, generation, shard)

    def seen_prefix(self, receiver: str, generation: int) -> str:
        """Every seen-ID shard of a generation is this prefix followed by the shard number."""
        return self._key(Kind.SEEN, receiver, generation, "")

    def seen_pattern(self, receiver: str = SCAN_ALL) -> str:
        """SCAN pattern of seen-ID shards (of one receiver: its name matched literally).

        A receiver's pattern also matches receivers whose names extend it with ``:``; callers
        that want one receiver keep the keys :meth:`parse` names it.
        """
        name = receiver if receiver == SCAN_ALL else glob_escape(receiver)
        return self._key(Kind.SEEN, name, SCAN_ALL)

    def filter_seq(self, receiver: str) -> str:
        """Counter: commits to a receiver (its Bloom filters say which they cover)."""
        return self._key(Kind.FILTER_SEQ, receiver)

    def filter_journal(self, receiver: str) -> str:
        """List: IDs of the commits since the last filter snapshot, one entry per commit."""
        return self._key(Kind.FILTER_JOURNAL, receiver)

    def filter_snapshot(self, receiver: str) -> str:
        """Hash: serialized Bloom filters per generation, and the commit sequence they cover."""
        return self._key(Kind.FILTER_SNAPSHOT, receiver)

    def stats(self, receiver: str) -> str:
        """Hash: counters of a receiver (records in, duplicates, lookups ...)."""
        return self._key(Kind.STATS, receiver)

    def pending(self, receiver: str, partition: int) -> str:
        """Hash: the delivery a sink partition wrote and has not yet marked (marker, IDs).

        Also the transactional writers that may hold a transaction of it open (one field
        each, see :mod:`onceflow.dedup.delivery`).
        """
        return self._key(Kind.PENDING, receiver, partition)

    # per stage, batch and partition
    def backup(self, stage: str, batch: int, partition: int) -> str:
        """Hash: chunk number -> encoded outputs of one task; ``done`` when it finished."""
        return self._key(Kind.BACKUP, stage, batch, partition)

    def state(self, node: str, partition: int) -> str:
        """Hash: encoded key -> encoded accumulator of a stateful combine."""
        return self._key(Kind.STATE, node, partition)

    def timers(self, kind: str, node: str, partition: int) -> str:
        """Sorted set of a combine's timers of one kind (``event``, ``processing``, ``expiry``)."""
        try:
            return self._key(TIMER_KINDS[kind], node, partition)
        except KeyError:
            msg = f"unknown timer kind {kind!r}; expected one of {', '.join(TIMER_KINDS)}"
            raise ConfigError(msg) from None

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
    if kind in _PER_NAME:
        return ParsedKey(namespace, kind, name=rest)
    if kind is Kind.BATCH:
        return ParsedKey(namespace, kind, batch=int(rest))
    if kind in _PER_PARTITION:
        name, partition = rest.rsplit(":", 1)
        return ParsedKey(namespace, kind, name=name, partition=int(partition))
    if kind is Kind.SEEN:
        name, generation, shard = rest.rsplit(":", 2)
        return ParsedKey(namespace, kind, name=name, generation=int(generation), shard=int(shard))
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


# Field of the GC hash: GC may have deleted seen-IDs of records older than this (it only rises,
# and is raised before anything is deleted); batches admit no record older than it again.
GC_FLOOR_FIELD = "forgotten_below_ms"
# Field of the meta hash: JSON list of the staging folders of the pipeline's file sinks (what
# ``onceflow gc`` clears of leftovers; paths only, never credentials).
STAGING_FIELD = "staging_folders"


def floor_bucket(watermark: int, horizon_ms: int, bucket_ms: int) -> int:
    """The oldest bucket still deduplicated, given the watermark the horizon is measured from.

    Records whose event time falls in an older bucket are late (dead-lettered: a copy could no
    longer be recognised); seen-IDs of older generations are no longer looked up, and GC
    deletes those below this floor minus its slack.
    """
    return max(0, watermark - horizon_ms) // bucket_ms
