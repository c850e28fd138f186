"""Event-time windows, triggers and panes: what a windowed combine is told to do.

A *window function* puts each record into windows by its event time:

* :class:`Fixed` — back-to-back windows of one size (``Fixed("1m")``);
* :class:`Sliding` — windows of ``size`` starting every ``every`` (``Sliding("10m", "1m")``):
  a record lands in ``size / every`` of them;
* :class:`Sessions` — a window per burst of activity of a key: records less than ``gap``
  apart share one, and windows that come to overlap merge;
* :class:`Global` — one window forever (it never closes in a stream: give it early panes).

A window's results leave as *panes*. The :class:`Trigger` says when: by default one pane when
the watermark passes the window's end (*on time*). Optional *early* panes come every so many
records or seconds of processing time before that; records that arrive after the on-time
pane but within the *allowed lateness* bring *late* panes (one per micro-batch, one per
record, or none until the final one). When the watermark passes ``end + allowed lateness``
the window *closes*: its final pane leaves and its state is deleted in the same commit;
records for a closed window go to dead letters with the reason.

*Accumulating* panes carry everything the window has seen so far; *discarding* panes only
what came since the previous pane (so panes of one window add up to its result).

Times are milliseconds of event time; windows are half-open, ``[start, end)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from onceflow.kernel.durations import Duration, parse_duration_ms
from onceflow.kernel.errors import ConfigError

# The bounds of the global window (inside the 64-bit range msgpack and Redis scores keep).
GLOBAL_START = -(1 << 53)
GLOBAL_END = 1 << 53

Span = tuple[int, int]  # [start, end) in ms


class WindowFn:
    """Assigns event times to windows (subclasses below)."""

    merging = False

    def assign(self, ts: int) -> list[Span]:
        """The windows a record with event time ``ts`` belongs to."""
        raise NotImplementedError

    def describe(self) -> str:
        """A short label for plans."""
        raise NotImplementedError


def _span_text(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


@dataclass(frozen=True)
class Fixed(WindowFn):
    """Back-to-back windows of ``size`` (a number of seconds or ``"1m"``), shifted by ``offset``."""

    size: Duration
    offset: Duration = 0
    size_ms: int = field(init=False, repr=False)
    offset_ms: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        size = parse_duration_ms(self.size, "window size")
        if size <= 0:
            msg = f"a window size must be positive, got {self.size!r}"
            raise ConfigError(msg)
        object.__setattr__(self, "size_ms", size)
        object.__setattr__(
            self, "offset_ms", parse_duration_ms(self.offset, "window offset") % size
        )

    def assign(self, ts: int) -> list[Span]:
        """The one window holding ``ts``."""
        start = ts - (ts - self.offset_ms) % self.size_ms
        return [(start, start + self.size_ms)]

    def describe(self) -> str:
        """``fixed 1m``."""
        return f"fixed {_span_text(self.size_ms)}"


@dataclass(frozen=True)
class Sliding(WindowFn):
    """Windows of ``size`` starting every ``every``; a record is in ``size / every`` of them."""

    size: Duration
    every: Duration
    offset: Duration = 0
    size_ms: int = field(init=False, repr=False)
    every_ms: int = field(init=False, repr=False)
    offset_ms: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        size = parse_duration_ms(self.size, "window size")
        every = parse_duration_ms(self.every, "window period")
        if size <= 0 or every <= 0:
            msg = (
                "sliding windows need a positive size and period, got "
                f"{self.size!r}, {self.every!r}"
            )
            raise ConfigError(msg)
        if every > size:
            msg = (
                f"sliding windows of {self.size!r} every {self.every!r} would leave gaps: the "
                "period must not be longer than the size (use Fixed for back-to-back windows)"
            )
            raise ConfigError(msg)
        object.__setattr__(self, "size_ms", size)
        object.__setattr__(self, "every_ms", every)
        object.__setattr__(
            self, "offset_ms", parse_duration_ms(self.offset, "window offset") % every
        )

    def assign(self, ts: int) -> list[Span]:
        """Every window whose span holds ``ts``, oldest first."""
        last = ts - (ts - self.offset_ms) % self.every_ms
        first = last - self.size_ms + self.every_ms
        return [(s, s + self.size_ms) for s in range(first, last + 1, self.every_ms)]

    def describe(self) -> str:
        """``sliding 10m every 1m``."""
        return f"sliding {_span_text(self.size_ms)} every {_span_text(self.every_ms)}"


@dataclass(frozen=True)
class Sessions(WindowFn):
    """A window per burst of a key's activity: records less than ``gap`` apart share one."""

    gap: Duration
    gap_ms: int = field(init=False, repr=False)
    merging = True

    def __post_init__(self) -> None:
        gap = parse_duration_ms(self.gap, "session gap")
        if gap <= 0:
            msg = f"a session gap must be positive, got {self.gap!r}"
            raise ConfigError(msg)
        object.__setattr__(self, "gap_ms", gap)

    def assign(self, ts: int) -> list[Span]:
        """A proto-session ``[ts, ts + gap)``; overlapping ones merge later."""
        return [(ts, ts + self.gap_ms)]

    def describe(self) -> str:
        """``sessions gap 30m``."""
        return f"sessions gap {_span_text(self.gap_ms)}"


@dataclass(frozen=True)
class Global(WindowFn):
    """One window for all time: it never closes in a stream, so give it early panes."""

    def assign(self, ts: int) -> list[Span]:
        """The global window."""
        return [(GLOBAL_START, GLOBAL_END)]

    def describe(self) -> str:
        """``global``."""
        return "global"


def merge_spans(spans: list[Span]) -> list[tuple[Span, list[int]]]:
    """Merge overlapping spans; each merged span with the indexes of the spans it took in."""
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    out: list[tuple[Span, list[int]]] = []
    for i in order:
        start, end = spans[i]
        if out and start < out[-1][0][1]:
            (s, e), members = out[-1]
            out[-1] = ((s, max(e, end)), [*members, i])
        else:
            out.append(((start, end), [i]))
    return out


class Late(enum.Enum):
    """When late panes fire (records after the on-time pane, within the allowed lateness)."""

    BATCH = "batch"  # one pane per micro-batch that brought late records to the window
    RECORD = "record"  # one pane per late record
    NONE = "none"  # none: late records show in the final pane only


@dataclass(frozen=True)
class Trigger:
    """When a window's panes fire (see the module docstring).

    ``early_every``: an early pane once at least this many records arrived since the last
    pane; ``early_seconds``: an early pane once this much processing time passed since the
    first record of the pane (checked at every micro-batch; a number of seconds, ``"5m"`` or
    a timedelta). ``on_time``: a pane when the watermark passes the window's end. ``late``:
    ``"batch"``, ``"record"`` or ``"none"``.
    Every window ends with exactly one final pane, when it closes.
    """

    early_every: int | None = None
    early_seconds: Duration | None = None
    on_time: bool = True
    late: Late | str = Late.BATCH
    early_ms: int | None = field(init=False, repr=False)  # early_seconds in ms

    def __post_init__(self) -> None:
        early = self.early_seconds
        object.__setattr__(
            self, "early_ms", None if early is None else parse_duration_ms(early, "early_seconds")
        )
        if self.early_every is not None and self.early_every < 1:
            msg = f"early_every must be at least 1, got {self.early_every}"
            raise ConfigError(msg)
        if self.early_ms is not None and self.early_ms <= 0:
            msg = f"early_seconds must be positive, got {self.early_seconds}"
            raise ConfigError(msg)
        try:
            object.__setattr__(self, "late", Late(self.late))
        except ValueError:
            msg = f"late must be 'batch', 'record' or 'none', got {self.late!r}"
            raise ConfigError(msg) from None

    @property
    def late_mode(self) -> Late:
        """``late`` as a :class:`Late`."""
        return Late(self.late)

    @property
    def has_early(self) -> bool:
        """Whether panes may fire before the watermark reaches the end."""
        return self.early_every is not None or self.early_seconds is not None

    @classmethod
    def final_only(cls) -> Trigger:
        """One pane per window, when it closes (``end + allowed lateness``)."""
        return cls(on_time=False, late=Late.NONE)

    def describe(self) -> str:
        """A short label for plans."""
        parts = []
        if self.early_every is not None:
            parts.append(f"early every {self.early_every} records")
        if self.early_ms is not None:
            parts.append(f"early every {self.early_ms / 1000:g}s")
        if self.on_time:
            parts.append("on time")
        if self.late_mode is not Late.NONE:
            parts.append(f"late per {self.late_mode.value}")
        parts.append("final")
        return ", ".join(parts)


class Accumulation(enum.Enum):
    """What a pane carries."""

    ACCUMULATING = "accumulating"  # everything the window has seen so far
    DISCARDING = "discarding"  # only what came since the previous pane


@dataclass(frozen=True)
class Windowing:
    """How a keyed stream is windowed: the window function, trigger, lateness, accumulation."""

    fn: WindowFn
    trigger: Trigger = field(default_factory=Trigger)
    allowed_lateness_ms: int = 0
    accumulation: Accumulation = Accumulation.ACCUMULATING

    @property
    def discarding(self) -> bool:
        """Whether panes carry only what came since the previous one."""
        return self.accumulation is Accumulation.DISCARDING

    @property
    def is_global(self) -> bool:
        """Whether this is the global window."""
        return isinstance(self.fn, Global)

    def closed(self, end: int, watermark: int) -> bool:
        """Whether a window ending at ``end`` has closed at ``watermark``."""
        return end < GLOBAL_END and end + self.allowed_lateness_ms <= watermark

    def describe(self) -> str:
        """``window sliding 10m every 1m; on time, late per batch, final; lateness 5m``."""
        text = f"window {self.fn.describe()}; {self.trigger.describe()}"
        if self.allowed_lateness_ms:
            text += f"; lateness {_span_text(self.allowed_lateness_ms)}"
        if self.discarding:
            text += "; discarding"
        return text


def windowing(
    fn: WindowFn | Duration,
    *,
    trigger: Trigger | None = None,
    allowed_lateness: Duration = 0,
    accumulation: Accumulation | str = Accumulation.ACCUMULATING,
) -> Windowing:
    """Check and assemble a :class:`Windowing` from the arguments of ``Stream.window``."""
    if not isinstance(fn, WindowFn):
        fn = Fixed(fn)
    lateness = parse_duration_ms(allowed_lateness, "allowed_lateness")
    if lateness < 0:
        msg = f"allowed_lateness must not be negative, got {allowed_lateness!r}"
        raise ConfigError(msg)
    try:
        acc = Accumulation(accumulation)
    except ValueError:
        msg = f"accumulation must be 'accumulating' or 'discarding', got {accumulation!r}"
        raise ConfigError(msg) from None
    return Windowing(fn, trigger or Trigger(), lateness, acc)


class Timing(enum.Enum):
    """Why a pane fired."""

    EARLY = "early"
    ON_TIME = "on_time"
    LATE = "late"


@dataclass(frozen=True, slots=True)
class Pane:
    """One result of one window of one key: ``(key, Pane(...))`` leaves a windowed combine.

    ``index`` counts the window's panes from 0; ``final`` marks the last (the window closed
    and its state is gone). Kafka sinks write ``value`` as the payload and the rest in the
    ``onceflow-window`` and ``onceflow-pane`` headers; JSON sinks write the fields.
    """

    value: Any
    start: int
    end: int
    timing: str
    index: int
    final: bool

    def as_list(self) -> list[Any]:
        """The fields in order (how the codec carries a pane)."""
        return [self.value, self.start, self.end, self.timing, self.index, self.final]

    def as_dict(self) -> dict[str, Any]:
        """The fields by name (how JSON sinks write a pane)."""
        return {
            "value": self.value,
            "start": self.start,
            "end": self.end,
            "timing": self.timing,
            "index": self.index,
            "final": self.final,
        }

    def window_header(self) -> bytes:
        """``start,end`` in ms."""
        return f"{self.start},{self.end}".encode()

    def pane_header(self) -> bytes:
        """``timing,index,final`` (``on_time,0,1``)."""
        return f"{self.timing},{self.index},{int(self.final)}".encode()
