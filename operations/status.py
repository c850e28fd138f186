"""What a pipeline's exactly-once state says about it (``onceflow status``).

Per receiver (a stage, or ``<sink>/delivered``): records in, committed and sent on, duplicates
dropped, late records, Bloom "maybe" answers and the Redis lookups they caused; per namespace:
the driver epoch, the last acknowledged micro-batch, backups still pending, the Redis memory
the namespace uses (SCAN + MEMORY USAGE, in bounded steps), the GC horizon and its last pass,
and how seen-IDs are stored (the layout, see :mod:`onceflow.kernel.seen_layout`).
Receivers and state kept per partition scope (:mod:`onceflow.kernel.scopes`) are summed over
their partitions.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from onceflow.backup.store import acknowledged, is_garbage
from onceflow.dedup.batch import lanes_of
from onceflow.kernel.keyspace import Keyspace, Kind
from onceflow.kernel.scopes import PLAN_FIELD, Connect, read_scopes, tag_client
from onceflow.kernel.seen_layout import LAYOUT, LAYOUT_FIELD
from onceflow.operations.gc import DEFAULT_SCAN_COUNT, read_meta, scan_steps
from onceflow.runtime.driver.heartbeat import running_driver
from onceflow.runtime.driver.rescale_checks import underway

# Counters shown per receiver, in this order (others follow, sorted).
_FIELDS = (
    "in",
    "committed",
    "out",
    "duplicates",
    "late",
    "bloom_maybe",
    "redis_lookups",
    "delivered",
    "delivered_again",
    "possible_copies",
)


@dataclass
class Status:
    """A namespace's state."""

    namespace: str
    epoch: int
    acked_batch: int
    watermark_ms: int
    dedup_time_ms: int
    horizon_ms: int
    generations: dict[str, int]  # live generation -> newest event time committed into it
    backups_pending: int
    backups_garbage: int
    memory_bytes: int
    keys: int
    memory_by_kind: dict[str, int] = field(default_factory=dict)
    receivers: dict[str, dict[str, int]] = field(default_factory=dict)
    gc: dict[str, str] = field(default_factory=dict)
    lanes: dict[str, dict[str, int]] = field(default_factory=dict)
    # per combine or process node: keys with state, windows (or process timers) waiting for
    # the watermark (``open_windows``, keys with an event timer) and the earliest such
    # timer, state with a time-to-live
    state: dict[str, dict[str, int]] = field(default_factory=dict)
    seen_layout: int = LAYOUT  # how seen-IDs are stored (see kernel.seen_layout)
    driver: dict[str, Any] | None = None  # the running driver (see runtime.heartbeat)
    # stage -> the steps it runs (the stored plan): a receiver is a stage, and a stage the
    # optimizer fused from unrelated steps is named after what they share (events/shuffled)
    stages: dict[str, list[str]] = field(default_factory=dict)
    parallelism: int = 0
    rescaling: dict[str, Any] | None = None  # a rescale under way (see runtime.driver.rescale)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)

    def text(self) -> str:
        """A person's view."""
        lines = [f"pipeline namespace {self.namespace}"]
        wm = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.watermark_ms / 1000)) + " UTC"
            if self.watermark_ms
            else "none"
        )
        lines.append(
            f"  driver epoch {self.epoch}, last committed micro-batch {self.acked_batch}, "
            f"watermark {wm}"
        )
        if self.driver is not None:
            lines.append(
                f"  running: process {self.driver.get('pid', '?')} on "
                f"{self.driver.get('host', '?')} (driver epoch {self.driver.get('epoch', '?')})"
            )
        if self.rescaling is not None:
            lines.append(
                f"  rescale under way from {self.parallelism} to "
                f"{self.rescaling.get('target')} partitions ({self.rescaling.get('phase')}): "
                "finish it with onceflow rescale, or a run with --rescale"
            )
        if self.lanes:
            newest = max(v["event_time_ms"] for v in self.lanes.values())
            oldest = min(v["event_time_ms"] for v in self.lanes.values())
            lines.append(
                f"  {len(self.lanes)} source partition(s): newest event time "
                f"{_when(newest)}, oldest partition at {_when(oldest)}"
            )
        lines.append(
            f"  backups pending {self.backups_pending} (acknowledged, awaiting GC: "
            f"{self.backups_garbage})"
        )
        kinds = ", ".join(
            f"{k} {_size(v)}" for k, v in sorted(self.memory_by_kind.items(), key=lambda x: -x[1])
        )
        lines.append(f"  Redis memory {_size(self.memory_bytes)} in {self.keys:,} keys ({kinds})")
        last = self.gc.get("last_pass_ms")
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(last) / 1000))
            if last
            else "never"
        )
        oldest = min(self.generations.values(), default=0)
        lines.append(
            f"  GC horizon {self.horizon_ms / 3_600_000:g} h, {len(self.generations)} seen-ID "
            f"generation(s) kept (oldest newest-event {_when(oldest)}, seen-ID layout "
            f"{self.seen_layout}), last pass {when}"
            + (f", {self.gc.get('passes', 0)} passes" if last else "")
        )
        for node, row in sorted(self.state.items()):
            text = f"  state of {node}: {row.get('keys', 0):,} key(s)"
            if row.get("open_windows"):
                text += (
                    f", {row['open_windows']:,} with windows open or an event-time timer set "
                    f"(the next due at event time "
                    f"{_when(row['next_close_ms'])})"
                )
            if row.get("ttl_keys"):
                text += f", {row['ttl_keys']:,} with a time-to-live"
            lines.append(text)
        if self.receivers:
            names = sorted(self.receivers)
            shown = [f for f in _FIELDS if any(f in self.receivers[n] for n in names)]
            width = max(len(n) for n in names)
            header = f"  {'receiver':<{width}} " + " ".join(f"{f:>15}" for f in shown)
            lines.append(header)
            for name in names:
                row = self.receivers[name]
                lines.append(
                    f"  {name:<{width}} " + " ".join(f"{row.get(f, 0):>15,}" for f in shown)
                )
        lines += [f"  stage {name} runs {' -> '.join(run)}" for name, run in self.stages.items()]
        return "\n".join(lines)


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + " UTC" if ms else "none"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def status(
    client: Any,
    namespace: str,
    scan_count: int = DEFAULT_SCAN_COUNT,
    connect: Connect | None = None,
) -> Status:
    """Read a namespace's state (read-only): one SCAN pass per hash tag, in bounded steps.

    ``connect`` gives the client of a partition scope's hash tag (on a Redis Cluster each
    may live on another master); without it every tag is read through ``client``.
    """
    ks = Keyspace(namespace)
    meta = read_meta(client, ks)
    acked = acknowledged(client, ks)
    found = _Found()
    for scope in read_scopes(client, ks).keyspaces():
        _scan(tag_client(client, scope, connect), scope, acked, scan_count, found)
    return Status(
        namespace=namespace,
        epoch=int(client.get(ks.epoch) or 0),
        acked_batch=acked,
        watermark_ms=int(client.hget(ks.clock, "watermark") or 0),
        dedup_time_ms=int(client.hget(ks.clock, "dedup_time") or 0),
        horizon_ms=int(meta.get("horizon_ms", 0)),
        generations={k.decode(): int(v) for k, v in sorted(client.hgetall(ks.generations).items())},
        backups_pending=found.pending,
        backups_garbage=found.garbage,
        memory_bytes=found.memory,
        keys=found.keys,
        memory_by_kind=found.by_kind,
        receivers=found.receivers,
        state=found.state,
        seen_layout=int(meta.get(LAYOUT_FIELD, LAYOUT)),
        driver=running_driver(client, ks),
        gc={k.decode(): v.decode() for k, v in client.hgetall(ks.gc).items()},
        lanes={
            lane: {"event_time_ms": newest, "active_ms": seen}
            for lane, (newest, seen) in sorted(lanes_of(client, ks).items())
        },
        stages=json.loads(meta.get(PLAN_FIELD) or "{}").get("stages", {}),
        parallelism=int(meta.get("parallelism") or 0),
        rescaling=underway(client, ks),
    )


@dataclass
class _Found:
    """What the SCAN passes over a namespace's hash tags add up to."""

    pending: int = 0
    garbage: int = 0
    keys: int = 0
    memory: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    receivers: dict[str, dict[str, int]] = field(default_factory=dict)
    state: dict[str, dict[str, int]] = field(default_factory=dict)


def _scan(client: Any, ks: Keyspace, acked: int, scan_count: int, found: _Found) -> None:
    """Add one hash tag's keys (the namespace's, or a partition scope's) to ``found``."""
    for step in scan_steps(client, ks.pattern(), scan_count):
        pipe = client.pipeline(transaction=False)
        for key in step:
            pipe.memory_usage(key)
        for key, size in zip(step, pipe.execute(), strict=True):
            parsed = ks.parse(key)
            kind = parsed.kind.value if parsed is not None else "other"
            found.by_kind[kind] = found.by_kind.get(kind, 0) + int(size or 0)
            found.memory += int(size or 0)
            garbage_backup = is_garbage(parsed, acked)
            if garbage_backup is True:
                found.garbage += 1
            elif garbage_backup is False:
                found.pending += 1
            elif parsed is not None and parsed.kind is Kind.STATS and parsed.name is not None:
                row = found.receivers.setdefault(parsed.name, {})
                for k, v in client.hgetall(key).items():
                    row[k.decode()] = row.get(k.decode(), 0) + int(v)
            elif parsed is not None and parsed.kind in _STATE_KINDS and parsed.name is not None:
                _count_state(client, key, parsed.kind, found.state.setdefault(parsed.name, {}))
        found.keys += len(step)


_STATE_KINDS = frozenset({Kind.STATE, Kind.EVENT_TIMERS, Kind.EXPIRY})


def _count_state(client: Any, key: str, kind: Kind, row: dict[str, int]) -> None:
    """Add one partition's state hash or timer set to its combine node's row."""
    if kind is Kind.STATE:
        row["keys"] = row.get("keys", 0) + int(client.hlen(key))
    elif kind is Kind.EXPIRY:
        row["ttl_keys"] = row.get("ttl_keys", 0) + int(client.zcard(key))
    else:
        row["open_windows"] = row.get("open_windows", 0) + int(client.zcard(key))
        first = client.zrange(key, 0, 0, withscores=True)
        if first:
            at = int(first[0][1])
            row["next_close_ms"] = min(row.get("next_close_ms", at), at)


def status_json(statuses: list[Status]) -> str:
    """``--json`` output."""
    return json.dumps([s.as_dict() for s in statuses], indent=2)
