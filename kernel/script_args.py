"""Each Lua script's KEYS and ARGV, encoded in one place: one typed function per script.

A script reads its arguments by position (see the opening comment of its file in
``kernel/lua``); the function of the same name here is the only code that knows those
positions. Callers name what they pass, and get back ``(keys, args)`` to hand to the
registered script (:class:`onceflow.kernel.scripts.Scripts`). Where a script takes KEYS by
index (seen-ID shards, state hashes: ``commit``, ``finish``, ``lookup``) the caller builds the
key table, starting from the fixed keys a function here returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from onceflow.kernel.keyspace import Keyspace

Call = tuple[list[str], list[Any]]
YES, NO = "1", "0"


@dataclass(frozen=True)
class Fence:
    """What every fenced script checks first (``_fence.lua``): KEYS 1-2 and ARGV 1-3.

    ``server`` is the run id of the Redis server the batch started on ('' checks nothing).
    """

    epoch_key: str
    token_key: str
    epoch: str
    token: str
    server: str = ""

    @property
    def keys(self) -> list[str]:
        """KEYS 1 and 2: the driver epoch and the task token."""
        return [self.epoch_key, self.token_key]

    @property
    def args(self) -> list[Any]:
        """ARGV 1 to 3: the epoch, the token and the server."""
        return [self.epoch, self.token, self.server]


def counted(pairs: Mapping[str, Any] | Sequence[tuple[Any, ...]]) -> list[Any]:
    """A counted run of ARGV: ``n`` then each item's fields (``n`` name, value pairs ...)."""
    items = list(pairs.items()) if isinstance(pairs, Mapping) else list(pairs)
    out: list[Any] = [len(items)]
    for item in items:
        out += list(item)
    return out


def claim(fence: Fence) -> Call:
    """``claim.lua``: this attempt takes its stage partition."""
    return fence.keys, fence.args


@dataclass(frozen=True)
class CommitKeys:
    """``commit.lua``'s fixed KEYS 3 to 10 (1 and 2 are the fence's)."""

    backup: str
    filter_seq: str
    filter_journal: str
    stats: str
    generations: str
    lanes: str
    lane_activity: str
    gc: str

    @classmethod
    def of(cls, ks: Keyspace, stage: str, batch: int, partition: int) -> CommitKeys:
        """The keys of one task's commits."""
        return cls(
            ks.backup(stage, batch, partition),
            ks.filter_seq(stage),
            ks.filter_journal(stage),
            ks.stats(stage),
            ks.generations,
            ks.lanes,
            ks.lane_activity,
            ks.gc,
        )

    def table(self, fence: Fence) -> list[str]:
        """The first KEYS of the call, in order; seen shards and state keys follow by index."""
        return [
            *fence.keys,
            self.backup,
            self.filter_seq,
            self.filter_journal,
            self.stats,
            self.generations,
            self.lanes,
            self.lane_activity,
            self.gc,
        ]


@dataclass(frozen=True)
class SeenBlob:
    """A chunk's seen fields for a script: ``n`` fields of one width, one run per shard."""

    n: int
    fields: bytes
    runs: bytes


def commit_args(
    fence: Fence,
    *,
    seen_value: bytes,
    chunk: tuple[str, bytes],
    journal: bytes,
    seen: SeenBlob,
    generation: int,
    newest: int,
    oldest: int,
    inputs: tuple[str, bytes],
    values: bytes,
    lanes: Sequence[tuple[str, int, int]],
    state: Sequence[Any],
    stats: Mapping[str, int],
) -> list[Any]:
    """``commit.lua``'s ARGV.

    ``chunk`` and ``inputs``: backup field and blob of the outputs and of the input IDs
    (``("", b"")``: none kept); ``values``: per field, its 4-byte seen value (``b""``: every
    mark is ``seen_value``); ``lanes``: (lane, newest event time, batch time); ``state``: the
    state and timer run (:func:`onceflow.dedup.state.state_args`); ``stats``: increments.
    """
    return [
        *fence.args,
        seen_value,
        *chunk,
        journal,
        seen.n,
        seen.fields,
        seen.runs,
        generation,
        newest,
        oldest,
        *inputs,
        values,
        *counted(lanes),
        *state,
        *counted(stats),
    ]


def finish_args(
    fence: Fence, outputs: bytes, state: Sequence[Any], stats: Mapping[str, int]
) -> list[Any]:
    """``finish.lua``'s ARGV (KEYS: the fence's, the backup, the stats, then state keys)."""
    return [*fence.args, outputs, *state, *counted(stats)]


def prepare_delivery(fence: Fence, pending: str, marker: str, ids: bytes, batch: int) -> Call:
    """``prepare_delivery.lua``: remember a delivery about to become visible."""
    return [*fence.keys, pending], [*fence.args, marker, ids, batch]


def log_delivery(
    fence: Fence,
    *,
    backup: str,
    stats: str,
    pending: str,
    counter: str,
    field: tuple[str, str],
    ids: bytes,
    n: int,
    end_pending: bool,
    copies: int,
    marker: str = "",
) -> Call:
    """``log_delivery.lua``: a delivery's IDs into the backup, as field ``prefix k suffix``.

    ``marker``: a transactional delivery's, kept as the partition's last (empty: none).
    """
    keys = [*fence.keys, backup, stats, pending]
    prefix, suffix = field
    end = YES if end_pending else NO
    args = [*fence.args, counter, prefix, suffix, ids, n, end, copies, marker]
    return keys, args


def note_writer(fence: Fence, pending: str, field: str, begins: bool) -> Call:
    """``note_writer.lua``: record (or forget) a transactional writer."""
    return [*fence.keys, pending], [*fence.args, field, YES if begins else NO]


def lookup_args(n: int, generations: int, fields: bytes, index: bytes) -> list[Any]:
    """``lookup.lua``'s ARGV (KEYS: the seen shards ``index`` refers to)."""
    return [n, generations, fields, index]


def catch_up(seq_key: str, journal: str, snapshot: str, covered: int) -> Call:
    """``catch_up.lua``: what a receiver's filters covering ``covered`` commits need."""
    return [seq_key, journal, snapshot], [covered]


def snapshot(
    fence: Fence,
    *,
    seq_key: str,
    journal: str,
    snapshot_key: str,
    covered: int,
    written: Sequence[tuple[str, bytes]],
    dropped: Sequence[str],
) -> Call:
    """``snapshot.lua``: filters covering commits 1..``covered`` replace generations."""
    keys = [*fence.keys, seq_key, journal, snapshot_key]
    args = [*fence.args, covered, *counted(written), len(dropped), *dropped]
    return keys, args


def batch_params(
    ks: Keyspace,
    batch: int,
    *,
    epoch: int,
    server: str,
    clock: tuple[int, int, int],
    fields: Mapping[str, int | str],
) -> Call:
    """``batch_params.lua``: a batch's parameters, unless an earlier attempt fixed them.

    ``clock``: the watermark, dedup time and time the clock hash moves to.
    """
    args: list[Any] = [epoch, server, *clock]
    for name, value in fields.items():
        args += [name, value]
    return [ks.epoch, ks.batch(batch), ks.clock], args


def ack(ks: Keyspace, batch: int) -> Call:
    """``ack.lua``: Spark committed every micro-batch up to ``batch``."""
    return [ks.acked], [batch]


def forget_generation(ks: Keyspace, generation: int, threshold: int) -> Call:
    """``forget_generation.lua``: forget a generation whose newest event is older."""
    return [ks.generations], [generation, threshold]


def raise_epoch(ks: Keyspace, epoch: int) -> Call:
    """``raise_epoch.lua``: copy a driver's epoch into a partition scope."""
    return [ks.epoch], [epoch]


def raise_generations(key: str, server: str, newest: Mapping[Any, int]) -> Call:
    """``raise_generations.lua``: raise fields of a hash that only rise (``server``: '' any)."""
    args: list[Any] = [server]
    for field, value in newest.items():
        args += [field, value]
    return [key], args


def raise_lanes(ks: Keyspace, lanes: Mapping[str, int], batch_time: int) -> Call:
    """``raise_lanes.lua``: source lanes' event-time marks (the at-least-once baseline)."""
    args: list[Any] = []
    for lane, newest in lanes.items():
        args += [lane, newest, batch_time]
    return [ks.lanes, ks.lane_activity], args


def expire_state(state: str, expiry: str, before: int, members: Sequence[Any]) -> Call:
    """``expire_state.lua``: delete keyed state whose time-to-live ran out before ``before``."""
    return [state, expiry], [before, *members]


def delete_if_equal(key: str, value: str) -> Call:
    """``delete_if_equal.lua``: delete ``key`` if it still holds ``value``."""
    return [key], [value]
