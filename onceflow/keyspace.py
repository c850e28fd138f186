"""Every Redis key Onceflow writes, under one namespace per pipeline.

Keys look like ``of:{<namespace>}:<kind>:...``. The braces are a Redis Cluster hash tag: all
keys of a pipeline live in one slot, so the Lua scripts that touch several of them at once
(seen-marks, backup, state, fencing) work on a cluster too. The namespace defaults to the
pipeline name; give two deployments of one pipeline different namespaces to keep them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from onceflow.errors import ConfigError

PREFIX = "of"


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

    def pattern(self, kind: str = "*") -> str:
        """A SCAN pattern for the namespace's keys of one kind (or all)."""
        return f"{self.root}:{kind}" if kind == "*" else f"{self.root}:{kind}:*"

    # pipeline-wide
    @property
    def meta(self) -> str:
        """Hash: settings fixed for the life of the pipeline (parallelism, buckets, horizon)."""
        return f"{self.root}:meta"

    @property
    def epoch(self) -> str:
        """Counter: fencing token of the current driver; bumped when a driver starts."""
        return f"{self.root}:epoch"

    @property
    def acked(self) -> str:
        """Last micro-batch Spark has committed: backups up to it are garbage."""
        return f"{self.root}:acked"

    @property
    def watermark(self) -> str:
        """Largest event time (ms) committed: the dedup horizon is measured back from it."""
        return f"{self.root}:wm"

    @property
    def acked_watermark(self) -> str:
        """The watermark when ``acked`` last moved: what the dedup floor is measured from.

        Taken from committed micro-batches only, so the floor is the same for every attempt
        of a batch (a replayed batch classifies records as late exactly as its first attempt
        did) and GC never reaches into the history an uncommitted batch may replay against.
        """
        return f"{self.root}:wmacked"

    @property
    def gc_floor(self) -> str:
        """Bucket below which GC may have deleted seen-IDs; commits with an older floor fail."""
        return f"{self.root}:gcfloor"

    @property
    def gc(self) -> str:
        """Hash: what the last GC pass did."""
        return f"{self.root}:gc"

    # per receiver (a stage or a sink) and partition
    def token(self, receiver: str, partition: int) -> str:
        """Counter: fencing token of the newest task attempt of a receiver partition."""
        return f"{self.root}:tok:{receiver}:{partition}"

    def seen(self, receiver: str, bucket: int, shard: int) -> str:
        """Hash: ID -> owner (``batch.partition``) for one time bucket and shard."""
        return f"{self.root}:seen:{receiver}:{bucket}:{shard}"

    def seen_pattern(self, receiver: str = "*") -> str:
        """SCAN pattern of seen-ID shards."""
        return f"{self.root}:seen:{receiver}:*"

    def filter_seq(self, receiver: str, partition: int) -> str:
        """Counter: commits that added IDs to a receiver partition's Bloom filters."""
        return f"{self.root}:fseq:{receiver}:{partition}"

    def filter_journal(self, receiver: str, partition: int) -> str:
        """List: IDs of the commits since the last filter snapshot, one entry per commit."""
        return f"{self.root}:fj:{receiver}:{partition}"

    def filter_snapshot(self, receiver: str, partition: int) -> str:
        """Hash: serialized Bloom filters per bucket, and the commit sequence they cover."""
        return f"{self.root}:fsnap:{receiver}:{partition}"

    def stats(self, receiver: str) -> str:
        """Hash: counters of a receiver (records in, duplicates, lookups ...)."""
        return f"{self.root}:stats:{receiver}"

    # per stage, batch and partition
    def backup(self, stage: str, batch: int, partition: int) -> str:
        """Hash: chunk number -> encoded outputs of one task; ``done`` when it finished."""
        return f"{self.root}:bk:{stage}:{batch}:{partition}"

    def state(self, node: str, partition: int) -> str:
        """Hash: encoded key -> encoded accumulator of a stateful combine."""
        return f"{self.root}:st:{node}:{partition}"
