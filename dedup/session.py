"""What every step of one exactly-once task shares: Redis, fencing tokens, counters.

A task's steps (filter trust, admission, commit, delivery) are separate modules; this is the
state they pass each other. Counters go two ways: ``counters`` are returned to the run's
metrics, ``pending`` are added to Redis by the next script call that takes them, so status
shows them even for a run that crashed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onceflow.dedup.config import DedupConfig
from onceflow.dedup.errors import FencedError, ServerChangedError, server_changed_message
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.script_args import Fence
from onceflow.kernel.seen_layout import SEEN_MARK
from onceflow.kernel.store import Store

FENCED = b"fenced"
SERVER = b"redis"  # who fenced: the server changed (see kernel.scripts.FENCE)


@dataclass
class TaskSession:
    """One exactly-once task's connection to its state."""

    store: Store
    ks: Keyspace
    config: DedupConfig
    epoch: str
    stage: str
    batch: int
    partition: int
    token: str = ""
    server: str = ""  # the run id of the Redis server the batch started on ('': unchecked)
    floor: int = 0  # the late floor: oldest event-time bucket admitted
    generation: int = 0  # where this batch's seen-IDs go
    live: tuple[int, ...] = ()  # generations still looked up, newest first
    limit_ms: int | None = None  # the newest event time admitted (None: no limit)
    # generations Redis still holds (GC has not forgotten them) when the task opened
    stored: frozenset[int] = frozenset()
    counters: dict[str, int] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)

    @property
    def seen_value(self) -> bytes:
        """The value of this task's seen-marks (a source record's may hold its fingerprint).

        Marks do not say who made them: each commit keeps its input IDs in the task's backup,
        and a later attempt of the task learns from there what an earlier one committed.
        """
        return SEEN_MARK

    @property
    def live_generations(self) -> list[int]:
        """Generations whose seen-IDs are still looked up, newest first."""
        return list(self.live) or [self.generation]

    @property
    def fence(self) -> Fence:
        """What every fenced script checks: the driver epoch, this task's token, the server."""
        return Fence(
            self.ks.epoch,
            self.ks.token(self.stage, self.partition),
            self.epoch,
            self.token,
            self.server,
        )

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter, both for the run's metrics and for Redis."""
        if n:
            self.counters[name] = self.counters.get(name, 0) + n
            self.pending[name] = self.pending.get(name, 0) + n

    def count_redis(self, name: str, n: int = 1) -> None:
        """Add to a counter in Redis only (the task counts it for the run itself)."""
        if n:
            self.pending[name] = self.pending.get(name, 0) + n

    def count_local(self, name: str, n: int = 1) -> None:
        """Add to a counter of the run's metrics only (a script counted it in Redis)."""
        if n:
            self.counters[name] = self.counters.get(name, 0) + n

    def uncount(self, counts: dict[str, int]) -> None:
        """Take back counts of work that was not committed after all."""
        for name, n in counts.items():
            self.counters[name] = self.counters.get(name, 0) - n
            self.pending[name] = self.pending.get(name, 0) - n

    def round_trip(self) -> None:
        """One more Redis round trip (a benchmark figure)."""
        self.counters["redis_round_trips"] = self.counters.get("redis_round_trips", 0) + 1

    def check(self, reply: Any) -> Any:
        """Raise :class:`FencedError` when a script says a newer driver or attempt owns this.

        A script that found another Redis server than the batch started on raises
        :class:`ServerChangedError` instead (the batch is run again).
        """
        if reply and reply[0] == FENCED:
            if reply[1] == SERVER:
                where = f"stage {self.stage!r} partition {self.partition} ({self.ks.tag})"
                raise ServerChangedError(server_changed_message(where, self.batch))
            who = reply[1].decode()
            msg = (
                f"stage {self.stage!r} batch {self.batch} partition {self.partition}: a "
                f"newer {who} owns this work; this {who} must stop (fenced)"
            )
            raise FencedError(msg)
        return reply
