"""Joins that are not windowed: by a time interval, and a stream against a table's versions.

Both are ``Stream.process`` stages underneath (per-key user state and event-time timers, see
:mod:`onceflow.runtime.user_state`), so their state, its changes and their outputs commit
together, exactly once, and a crash then rerun neither loses nor repeats a pair. Both sides
of a join are tagged and merged into one keyed stream first.

**Interval join** (``a.interval_join(name, b, lower, upper)``, Flink's): ``(key, (a, b))``
for every ``a`` and ``b`` of one key with ``a.ts + lower <= b.ts <= a.ts + upper``. Each side
is buffered until the watermark passes the last time a partner can have (``a.ts + upper``,
``b.ts - lower``); a timer prunes it then. A record behind the watermark when it arrives may
have missed partners already pruned: it is a dead letter (``late_for_join``, "late for the
interval join ..."), never joined partially.

**Temporal join** (``stream.join_table(name, table, how="left")``): the table side is a
stream of versions of each key's row (a compacted Kafka topic read with
``KafkaSource(..., envelope=True)``, keyed by the Kafka key, or a change stream keyed by its
rows' key, a :class:`~onceflow.kernel.changes.Change` standing for its row); a row of None —
a tombstone, a deleted row — deletes the key from that time on. Each stream record is joined
with the row the table held **as of the record's event time**: the newest version with a
time at or before it. To be sure every version up to that time has arrived, a record waits
until the watermark passes its time (an event-time timer), then leaves as
``(key, (value, row))``; with ``how="left"`` ``row`` is None when the table had none, with
``"inner"`` such records are not emitted. The documented choice for a late table side: a
version that arrives behind the watermark applies to the records that have not left yet
(those at or after its time), never to records already emitted (no retraction). A stream
record that arrives behind the watermark leaves at once, joined with what the table holds;
if the version of its time has been pruned it is a dead letter ("late for the table join
..."), never joined with a wrong row.

A key's versions and waiting records are its state, keyed by the table's key. A version is
pruned once a newer one is at or before the time of the last record that left, or, while no
record of the key waits, the watermark (a timer, armed only when there is something to
prune); a deletion once it is itself at or before that time. Then, with no record waiting,
nothing of a deleted key is kept: its state is deleted in the commit of that step. A record
that arrives later still, behind the watermark, with a time before the deletion, joins as
with a key never in the table: what was deleted is no longer known.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from typing import Any

from onceflow.kernel.changes import MESSAGE, TRUNCATE, Change
from onceflow.kernel.durations import Duration, parse_duration_ms
from onceflow.pipeline.errors import PipelineError
from onceflow.pipeline.key_types import KeySides, check_declared
from onceflow.runtime.spec import Each
from onceflow.runtime.user_state import (
    BagSpec,
    Context,
    MapSpec,
    Timer,
    TimestampedValue,
    ValueSpec,
)

Stream = Any  # onceflow.pipeline.api.Stream (that module calls this one: no import cycle)

LEFT = BagSpec[list[Any]]("left")  # [ts, value] of the left side, kept until no partner can come
RIGHT = BagSpec[list[Any]]("right")
VERSIONS = MapSpec[int, Any]("versions")  # version time -> row (None: deleted)
WAITING = BagSpec[list[Any]]("waiting")  # [ts, value] of stream records waiting for the watermark
FLOOR = ValueSpec[int]("floor")  # versions before this time were pruned
PRUNE = "prune"  # the timer at the first time something kept can go (both joins)
DUE = "due"  # join_table: the timer at a key's earliest waiting record


class LateForJoin(ValueError):
    """A record behind the watermark where the join may have pruned its partners."""

    dead_letter_code = "late_for_join"  # its letters' code (runtime.ops.record_text)


def _tag(side: int) -> Any:
    return lambda v: (side, v)


def _tagged(
    left: Stream, name: str, right: Stream, what: str, roles: tuple[str, str] = ("", "")
) -> tuple[Stream, KeySides]:
    """Both sides tagged and merged, and the check that they are keyed alike."""
    for stream in (left, right):
        stream._need_keyed(name, "join")  # noqa: SLF001 - same package
        if stream.windowing is not None:
            msg = f"join {name!r}: stream {stream.name!r} is windowed; this join is not"
            raise PipelineError(msg)
    join = f"{what} {name!r}"
    sides = (f"{roles[0]}{left.name!r}", f"{roles[1]}{right.name!r}")
    check_declared(join, sides, (left.key_kind, right.key_kind))
    merged = left.pipeline.merge(
        f"{name}.both",
        left.map_values(f"{name}.left", _tag(0)),
        right.map_values(f"{name}.right", _tag(1)),
    )
    return merged, KeySides(join, sides)


def _keyed(stream: Stream, name: str, left: Stream) -> Stream:
    """The process stage's ``(key, pair)`` outputs as a keyed stream (keyed as ``left``)."""
    keyed = stream._flat(name, "keyed", None, keyed=True, each=Each.PASS)  # noqa: SLF001
    keyed.key_kind = left.key_kind
    return keyed


def interval_join(
    left: Stream, name: str, right: Stream, lower: Duration, upper: Duration
) -> Stream:
    """See the module docstring; ``lower``/``upper`` in seconds (negative allowed) or text."""
    lo = _signed_ms(lower, name, "lower")
    hi = _signed_ms(upper, name, "upper")
    if lo > hi:
        msg = f"interval_join {name!r}: lower ({lower!r}) is after upper ({upper!r})"
        raise PipelineError(msg)
    tagged_both, sides = _tagged(left, name, right, "interval_join")

    def on_element(key: Any, tagged: Any, ctx: Context) -> Iterator[Any]:
        side, value = tagged
        sides.see(side, key)
        ts = ctx.timestamp
        if ts < ctx.watermark:
            msg = (
                f"late for the interval join {name!r}: event time {ts} is behind the watermark "
                f"{ctx.watermark}, where partners may be gone (allow more out-of-orderness)"
            )
            raise LateForJoin(msg)
        if side == 0:
            for r_ts, r in ctx.state(RIGHT).read():
                if ts + lo <= r_ts <= ts + hi:
                    yield key, (value, r)
            ctx.state(LEFT).add([ts, value])
        else:
            for l_ts, a in ctx.state(LEFT).read():
                if l_ts + lo <= ts <= l_ts + hi:
                    yield key, (a, value)
            ctx.state(RIGHT).add([ts, value])
        # the prune timer moves earlier only (the bags are not read again for it)
        end = ts + hi if side == 0 else ts - lo
        armed = ctx.timers.get(PRUNE)
        if armed is None or end + 1 < armed.time:
            ctx.timers.set_event_time(end + 1, PRUNE)

    def on_timer(key: Any, timer: Timer, ctx: Context) -> None:
        w = ctx.watermark
        ctx.state(LEFT).write([e for e in ctx.state(LEFT).read() if e[0] + hi >= w])
        ctx.state(RIGHT).write([e for e in ctx.state(RIGHT).read() if e[0] - lo >= w])
        _arm(ctx, lo, hi)

    joined = tagged_both.process(
        f"{name}.pairs", on_element, states=[LEFT, RIGHT], on_timer=on_timer
    )
    return _keyed(joined, name, left)


def _arm(ctx: Context, lo: int, hi: int) -> None:
    """The prune timer at the first moment an entry can go (none: no timer)."""
    ends = [ts + hi for ts, _v in ctx.state(LEFT).read()]
    ends += [ts - lo for ts, _v in ctx.state(RIGHT).read()]
    if ends:
        ctx.timers.set_event_time(min(ends) + 1, PRUNE)
    else:
        ctx.timers.clear(PRUNE)


def _signed_ms(value: Duration, name: str, what: str) -> int:
    if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
        return -parse_duration_ms(-value, f"interval_join {name!r} {what}")
    if isinstance(value, str) and value.startswith("-"):
        return -parse_duration_ms(value[1:], f"interval_join {name!r} {what}")
    return parse_duration_ms(value, f"interval_join {name!r} {what}")


def join_table(stream: Stream, name: str, table: Stream, how: str = "left") -> Stream:
    """See the module docstring."""
    if how not in ("left", "inner"):
        msg = f"join_table {name!r}: how={how!r} is not 'left' or 'inner'"
        raise PipelineError(msg)
    inner = how == "inner"
    tagged_both, sides = _tagged(stream, name, table, "join_table", ("the stream ", "the table "))

    def emit(key: Any, ts: int, value: Any, ctx: Context, times: list[int]) -> Iterator[Any]:
        floor = ctx.state(FLOOR).read()
        if floor is not None and ts < floor:
            msg = (
                f"late for the table join {name!r}: event time {ts} is before {floor}, the "
                "oldest version of the table row still kept (allow more out-of-orderness)"
            )
            raise LateForJoin(msg)
        row = _as_of(ctx, times, ts)
        if row is not None or not inner:
            yield TimestampedValue((key, (value, row)), ts)

    def on_element(key: Any, tagged: Any, ctx: Context) -> Iterator[Any]:
        side, value = tagged
        sides.see(side, key)
        ts = ctx.timestamp
        if side == 1:
            row = _table_row(name, value)
            versions = ctx.state(VERSIONS)
            versions.put(ts, row)
            # something can go once the watermark passes this version: arm the prune timer
            # there, or keep it if earlier (records waiting: their release prunes)
            if (row is None or len(versions) > 1) and not len(ctx.state(WAITING)):
                armed = ctx.timers.get(PRUNE)
                if armed is None or ts < armed.time:
                    ctx.timers.set_event_time(ts, PRUNE)
            return
        if ts < ctx.watermark:  # late: it leaves now, with what the table holds
            yield from emit(key, ts, value, ctx, sorted(ctx.state(VERSIONS).keys()))
            return
        ctx.state(WAITING).add([ts, value])
        armed = ctx.timers.get(DUE)
        if armed is None or ts < armed.time:
            ctx.timers.set_event_time(ts, DUE)

    def on_timer(key: Any, timer: Timer, ctx: Context) -> Iterator[Any]:
        if timer.tag == PRUNE:  # a key without waiting records: what the watermark passed
            if not len(ctx.state(WAITING)):
                _prune(ctx, ctx.watermark)
                _arm_prune(ctx)
            return
        # One timer per key, at its earliest waiting record: a firing releases every record
        # the watermark has passed (each with its own time), in time order, then moves on.
        waiting = ctx.state(WAITING)
        due, rest = _split(waiting.read(), ctx.watermark)
        if rest:
            ctx.timers.set_event_time(min(e[0] for e in rest), DUE)
        if not due:
            return
        waiting.write(rest)
        times = sorted(ctx.state(VERSIONS).keys())
        for ts, value in due:
            yield from emit(key, ts, value, ctx, times)
        _prune(ctx, due[-1][0])
        if not rest:
            _arm_prune(ctx)

    joined = tagged_both.process(
        f"{name}.as-of", on_element, states=[VERSIONS, WAITING, FLOOR], on_timer=on_timer
    )
    return _keyed(joined, name, stream)


def _split(waiting: list[list[Any]], watermark: int) -> tuple[list[list[Any]], list[list[Any]]]:
    """The waiting records the watermark has passed, in time order (ties: arrival), and the rest."""
    due = sorted((e for e in waiting if e[0] <= watermark), key=lambda e: int(e[0]))
    return due, [e for e in waiting if e[0] > watermark]


def _as_of(ctx: Context, times: list[int], ts: int) -> Any:
    """The row the table held at ``ts``: the newest version at or before it (None: none).

    ``times`` are the key's version times, sorted.
    """
    at = bisect_right(times, ts)
    return ctx.state(VERSIONS).get(times[at - 1]) if at else None


def _table_row(name: str, value: Any) -> Any:
    """A table side's value as the key's row: a :class:`Change` gives its row (a delete: None).

    A truncate or a message changes no one key's row: a dead letter saying so.
    """
    if not isinstance(value, Change):
        return value
    if value.op in (TRUNCATE, MESSAGE):
        msg = (
            f"join_table {name!r}: the table side got a {value.op} change of {value.table!r}, "
            "which is not a change of one key's row; leave it out before the join "
            "(.filter(..., lambda c: c.op not in ('truncate', 'message')))"
        )
        raise ValueError(msg)
    return value.row


def _prune(ctx: Context, upto: int) -> None:
    """Forget the versions no record can read any more, and the key once nothing is left.

    No record will read a version older than the newest one at or before ``upto``: records
    still waiting are later, and records still to come are at or after the watermark (or
    late, and then checked against the floor). ``upto`` is the time of the last record
    released, or, with none waiting, the watermark. A deletion (a None row) that is that
    newest version goes too: a record after it finds no row, as if the key had never been in
    the table. When no version and no waiting record is left, the floor goes as well, and
    with it the key's state (deleted in the commit of this call's changes).
    """
    versions = ctx.state(VERSIONS)
    times = sorted(versions.keys())
    older = times[: bisect_right(times, upto)]
    gone = older if older and versions.get(older[-1]) is None else older[:-1]
    for t in gone:
        versions.remove(t)
    floor = ctx.state(FLOOR)
    kept = floor.read()
    if gone and (kept is None or older[-1] > kept):  # (a late version's pruning: not lower)
        floor.write(older[-1])
    if not len(versions) and not len(ctx.state(WAITING)):
        floor.clear()


def _arm_prune(ctx: Context) -> None:
    """The prune timer at the first time a version can go: a newer one's, or a deletion's.

    None when there is nothing to prune (one row, no deletion): a key whose row never changes
    costs no timer. (A version that arrives arms it at its own time if that is earlier: a
    timer early is a firing that prunes nothing, then this.)
    """
    versions = ctx.state(VERSIONS)
    times = sorted(versions.keys())
    deleted = [t for t in times if versions.get(t) is None]
    when = min(times[1:2] + deleted[:1], default=None)
    if when is None:
        ctx.timers.clear(PRUNE)
    else:
        ctx.timers.set_event_time(when, PRUNE)
