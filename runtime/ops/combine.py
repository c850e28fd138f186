"""A combine without windows: per-key accumulators of one node of one task.

In a bounded run it holds its accumulators for the whole task. In a streaming run a full or
final combine is *stateful*: each chunk's per-key deltas are merged into state kept by the
runtime (Redis). A partial combine with IDs on is *chunked*: its per-chunk deltas are
committed with the chunk, and a retried task re-seeds its sums from them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from onceflow.kernel import codec
from onceflow.kernel.records import StateWrite
from onceflow.runtime.spec import OpSpec, Phase

StateReader = Callable[[str, Sequence[bytes]], Mapping[bytes, bytes | None]]
EXPIRY_TIMERS = "expiry"  # expiries onceflow gc deletes
# expiries the pipeline fires itself, sending (key, None) on (the processing-time timers of
# window_panes.PROCESSING_TIMERS: the ticker and the timer reader find them)
EXPIRY_DELETES = "processing"


class CombineOp:
    """Per-key accumulators of one combine node.

    With a time-to-live, a stateful combine stores ``[accumulator, expiry]`` and treats a key
    whose expiry (batch time) has passed as new; ``onceflow gc`` deletes such keys, unless
    the expiry is a delete (``expiry_deletes``): then its timer is one the end of a task
    fires (:meth:`expired`).
    """

    def __init__(self, spec: OpSpec, stateful: bool, chunked: bool, now: int | None) -> None:
        assert spec.combine_fn is not None
        self.spec = spec
        self.fn = spec.combine_fn
        self.stateful = stateful
        self.chunked = chunked  # a partial whose per-chunk deltas are committed with the chunk
        self.merging = spec.phase is Phase.FINAL
        self.ttl_ms = spec.ttl_ms if stateful else None
        self.expiry_timers = EXPIRY_DELETES if spec.expiry_deletes else EXPIRY_TIMERS
        self.now = now or 0
        self.acc: dict[bytes, list[Any]] = {}  # key bytes -> [key, accumulator, max ts]
        self.running: dict[bytes, list[Any]] = {}  # chunked: deltas of committed chunks
        self.touched: dict[bytes, list[Any]] = {}  # stateful: keys changed by this batch
        self.pending: dict[bytes, list[Any]] = {}

    def add(self, kb: bytes, key: Any, value: Any, ts: int) -> None:
        """Fold one value (or, after lifting, one accumulator) into the key's accumulator."""
        entry = self.acc.get(kb)
        fn = self.fn
        if entry is None:
            acc = value if self.merging else fn.add(fn.create(), value)
            self.acc[kb] = [key, acc, ts]
            return
        entry[1] = fn.merge(entry[1], value) if self.merging else fn.add(entry[1], value)
        entry[2] = max(entry[2], ts)

    def add_many(
        self,
        kbs: Sequence[bytes],
        keys: Sequence[Any],
        values: Sequence[Any],
        ts: Sequence[int],
        fail: Callable[[int, BaseException], None],
    ) -> None:
        """:meth:`add` of every element, in one loop; a value that fails goes to ``fail``.

        Its key's accumulator stays as it was, and the loop goes on with the next value.
        """
        acc, fn, merging = self.acc, self.fn, self.merging
        fold = fn.merge if merging else fn.add
        create = fn.create
        n = len(kbs)
        i = 0
        while i < n:
            try:
                for i in range(i, n):  # noqa: B020 - resumed after a failure
                    kb = kbs[i]
                    if kb in acc:
                        entry = acc[kb]
                        entry[1] = fold(entry[1], values[i])
                        if ts[i] > entry[2]:  # noqa: PLR1730 - max() would be a call per value
                            entry[2] = ts[i]
                    else:
                        acc[kb] = [
                            keys[i],
                            values[i] if merging else fold(create(), values[i]),
                            ts[i],
                        ]
                return
            except Exception as exc:  # noqa: BLE001 - user code: the element is a dead letter
                fail(i, exc)
                i += 1

    def touch(self, kb: bytes, key: Any, ts: int) -> None:
        """Remember a key whose effect was committed earlier (a replayed record)."""
        entry = self.touched.get(kb)
        if entry is None:
            self.touched[kb] = [key, ts]
        elif ts > entry[1]:
            entry[1] = ts

    def stored(self, raw: bytes | None) -> Any:
        """The accumulator in a stored value (None: no state, or it expired)."""
        if raw is None:
            return None
        value = codec.decode(raw)
        if self.ttl_ms is None:
            return value
        acc, expiry = value
        return None if expiry <= self.now else acc

    def updates(self, reader: StateReader) -> StateWrite:
        """New encoded state for every key with a delta in this chunk."""
        write = StateWrite()
        if not self.acc:
            return write
        current = reader(self.spec.name, list(self.acc))
        expiry = self.now + self.ttl_ms if self.ttl_ms is not None else None
        timers: dict[bytes, int | None] = {}
        for kb, (key, delta, ts) in self.acc.items():
            old = self.stored(current.get(kb))
            new = delta if old is None else self.fn.merge(old, delta)
            if expiry is None:
                write.values[kb] = codec.encode(new)
            else:
                write.values[kb] = codec.encode([new, expiry])
                timers[kb] = expiry
            self.pending[kb] = [key, ts]
        if timers:
            write.timers[self.expiry_timers] = timers
        return write

    def expired(self, reader: StateReader, due: Sequence[bytes]) -> tuple[list[bytes], StateWrite]:
        """Of the keys whose expiry timer is due, those whose state expired, and its deletion.

        A key updated since its timer was read has a later expiry: it stays.
        """
        write = StateWrite()
        if not due:
            return [], write
        current = reader(self.spec.name, list(due))
        gone = [
            kb for kb in due if (raw := current.get(kb)) is not None and self.stored(raw) is None
        ]
        timers: dict[bytes, int | None] = {}
        for kb in gone:
            write.values[kb] = None
            timers[kb] = None
        if timers:
            write.timers[self.expiry_timers] = timers
        return gone, write

    def chunk_committed(self) -> None:
        """The chunk is durable: its keys count as touched, its deltas join the running sum."""
        for kb, (key, ts) in self.pending.items():
            self.touch(kb, key, ts)
        self.pending.clear()
        if self.chunked:
            for kb, (key, acc, ts) in self.acc.items():
                self.seed(kb, key, acc, ts)
        self.acc.clear()

    def reset_chunk(self) -> None:
        """Forget the chunk's deltas (its commit was refused and it will be redone)."""
        self.pending.clear()
        self.acc.clear()

    def seed(self, kb: bytes, key: Any, acc: Any, ts: int) -> None:
        """Merge a committed delta (of this attempt, or replayed from backup) into the sum."""
        entry = self.running.get(kb)
        if entry is None:
            self.running[kb] = [key, acc, ts]
            return
        entry[1] = self.fn.merge(entry[1], acc)
        if ts > entry[2]:  # noqa: PLR1730 - max() would be a call per key and chunk
            entry[2] = ts

    def drain(self) -> dict[bytes, list[Any]]:
        """Everything accumulated, for the end-of-task flush; leaves the combine empty."""
        if self.chunked:
            for kb, (key, acc, ts) in self.acc.items():
                self.seed(kb, key, acc, ts)
            out, self.running = self.running, {}
        else:
            out = self.acc
        self.acc = {}
        return out
