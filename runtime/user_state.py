"""User state and timers per key, for ``Stream.process`` (the public half).

A process function declares the state it keeps per key as *specs* (:class:`ValueSpec`,
:class:`BagSpec`, :class:`MapSpec`, :class:`CombiningSpec`), named and typed, and reaches
the key's state through ``ctx.state(spec)``, which gives a typed handle
(:class:`ValueState`, :class:`BagState`, :class:`MapState`, :class:`CombiningState`).
``ctx.timers`` sets, reads and clears the key's timers, each named by a tag: an event-time
timer fires once the stage's watermark reaches its time, a processing-time one once the
micro-batch's time does; ``on_timer(key, timer, ctx)`` then runs with the same state.

How a key's state is stored (one Redis hash field per key, MessagePack, never pickle) and
when functions run is :mod:`onceflow.runtime.ops.process`'s; this module is what the user's
functions touch. Values kept in state must be encodable: None, bool, int, float, str, bytes,
list, tuple and dict (as records must).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from onceflow.runtime.combine_fn import CombineFn

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")
H_co = TypeVar("H_co", covariant=True)

EVENT_TIME = "event"
PROCESSING_TIME = "processing"

Cells = dict[str, Any]  # a key's state by spec name, in its live (decoded) form


class StateSpec(Generic[H_co]):
    """A named piece of per-key state; ``ctx.state(spec)`` gives its handle.

    The name is part of the stored format: renaming a spec starts its state over.
    """

    kind: ClassVar[str] = ""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            msg = f"a state spec needs a non-empty string name, got {name!r}"
            raise ValueError(msg)
        self.name = name

    def bind(self, cells: Cells) -> H_co:
        """The handle over this state in ``cells`` (one key's state)."""
        raise NotImplementedError

    def wire(self, live: Any) -> Any:
        """The stored form of a live value (the same for all but maps)."""
        return live

    def live(self, wire: Any) -> Any:
        """The live form of a stored value."""
        return wire

    def describe(self) -> str:
        """``kind name``, for plans and the plan's fingerprint."""
        return f"{self.kind} {self.name}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class ValueState(Generic[T]):
    """One value per key: ``read()`` (None when unset), ``write(v)``, ``clear()``."""

    __slots__ = ("_cells", "_name")

    def __init__(self, cells: Cells, name: str) -> None:
        self._cells = cells
        self._name = name

    def read(self) -> T | None:
        """The value, or None when none was written (or it was cleared, or it expired)."""
        value: T | None = self._cells.get(self._name)
        return value

    def write(self, value: T) -> None:
        """Replace the value (writing None clears it)."""
        if value is None:
            self._cells.pop(self._name, None)
        else:
            self._cells[self._name] = value

    def clear(self) -> None:
        """Forget the value."""
        self._cells.pop(self._name, None)


class BagState(Generic[T]):
    """A list of values per key, in the order they were added."""

    __slots__ = ("_cells", "_name")

    def __init__(self, cells: Cells, name: str) -> None:
        self._cells = cells
        self._name = name

    def read(self) -> list[T]:
        """The values (a copy: change the bag with :meth:`add`, :meth:`write`, :meth:`clear`)."""
        return list(self._cells.get(self._name, ()))

    def add(self, value: T) -> None:
        """Append one value."""
        self._cells.setdefault(self._name, []).append(value)

    def write(self, values: Iterable[T]) -> None:
        """Replace the bag's values (to drop old ones, keep the last n ...)."""
        items = list(values)
        if items:
            self._cells[self._name] = items
        else:
            self._cells.pop(self._name, None)

    def clear(self) -> None:
        """Empty the bag."""
        self._cells.pop(self._name, None)

    def __len__(self) -> int:
        return len(self._cells.get(self._name, ()))


class MapState(Generic[K, V]):
    """A map per key (its keys: any encodable value that hashes, e.g. str, int, tuple)."""

    __slots__ = ("_cells", "_name")

    def __init__(self, cells: Cells, name: str) -> None:
        self._cells = cells
        self._name = name

    def _map(self) -> dict[K, V]:
        found: dict[K, V] = self._cells.get(self._name, {})
        return found

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value under ``key``, or ``default``."""
        return self._map().get(key, default)

    def put(self, key: K, value: V) -> None:
        """Set the value under ``key``."""
        self._cells.setdefault(self._name, {})[key] = value

    def remove(self, key: K) -> None:
        """Drop ``key`` (nothing happens when it is absent)."""
        found = self._map()
        found.pop(key, None)
        if not found:
            self._cells.pop(self._name, None)

    def items(self) -> list[tuple[K, V]]:
        """The entries, in the order they were first put."""
        return list(self._map().items())

    def keys(self) -> list[K]:
        """The keys, in the order they were first put."""
        return list(self._map())

    def clear(self) -> None:
        """Empty the map."""
        self._cells.pop(self._name, None)

    def __contains__(self, key: object) -> bool:
        return key in self._map()

    def __len__(self) -> int:
        return len(self._map())


class CombiningState(Generic[T]):
    """A value folded with a :class:`CombineFn`: ``add(v)`` folds, ``read()`` extracts."""

    __slots__ = ("_cells", "_fn", "_name")

    def __init__(self, cells: Cells, name: str, fn: CombineFn) -> None:
        self._cells = cells
        self._name = name
        self._fn = fn

    def add(self, value: Any) -> None:
        """Fold one value into the accumulator."""
        fn = self._fn
        acc = self._cells[self._name] if self._name in self._cells else fn.create()
        self._cells[self._name] = fn.add(acc, value)

    def read(self) -> T:
        """The result so far (the combiner's result of nothing when nothing was added)."""
        fn = self._fn
        acc = self._cells[self._name] if self._name in self._cells else fn.create()
        result: T = fn.extract(acc)
        return result

    def clear(self) -> None:
        """Start over."""
        self._cells.pop(self._name, None)


class ValueSpec(StateSpec[ValueState[T]]):
    """Declares a :class:`ValueState`: ``ValueSpec[int]("count")``."""

    kind = "value"

    def bind(self, cells: Cells) -> ValueState[T]:
        """A handle over this value in ``cells``."""
        return ValueState(cells, self.name)


class BagSpec(StateSpec[BagState[T]]):
    """Declares a :class:`BagState`: ``BagSpec[float]("amounts")``."""

    kind = "bag"

    def bind(self, cells: Cells) -> BagState[T]:
        """A handle over this bag in ``cells``."""
        return BagState(cells, self.name)


class MapSpec(StateSpec[MapState[K, V]]):
    """Declares a :class:`MapState`: ``MapSpec[str, int]("per_merchant")``.

    Stored as a list of ``[key, value]`` pairs (MessagePack maps take only string keys).
    """

    kind = "map"

    def bind(self, cells: Cells) -> MapState[K, V]:
        """A handle over this map in ``cells``."""
        return MapState(cells, self.name)

    def wire(self, live: Any) -> Any:
        """Pairs, in insertion order."""
        return [[k, v] for k, v in live.items()]

    def live(self, wire: Any) -> Any:
        """A dict again."""
        return {k: v for k, v in wire}


class CombiningSpec(StateSpec[CombiningState[T]]):
    """Declares a :class:`CombiningState` folding with ``fn``: ``CombiningSpec("total", Sum())``."""

    kind = "combining"

    def __init__(self, name: str, fn: CombineFn) -> None:
        super().__init__(name)
        if not isinstance(fn, CombineFn):
            msg = f"CombiningSpec {name!r} needs a CombineFn, got {type(fn).__name__}"
            raise ValueError(msg)
        self.fn = fn

    def bind(self, cells: Cells) -> CombiningState[T]:
        """A handle over this accumulator in ``cells``."""
        return CombiningState(cells, self.name, self.fn)

    def describe(self) -> str:
        """``combining name Combiner`` (another combiner stores another format)."""
        return f"{super().describe()} {type(self.fn).__qualname__}"


class Timer(NamedTuple):
    """A timer of a key: its tag, domain, time (ms) and hold.

    ``domain`` is ``"event"`` or ``"processing"``; ``hold`` is the event time of the record
    that set it (the outputs of a processing-time timer carry it, or the watermark the firing
    micro-batch started from if that has passed it: see ``firing_time`` in
    :mod:`onceflow.runtime.ops.process`).
    """

    tag: str
    domain: str
    time: int
    hold: int


class TimestampedValue(NamedTuple):
    """An output of a process or timer function with an event time of its own (ms).

    Outputs carry ``ctx.timestamp`` by default (the element's time, or the firing timer's);
    yield ``TimestampedValue(value, ts)`` to give one a later time, as Beam's
    ``outputWithTimestamp`` does — for instance a timer that releases several buffered
    records, each with its own time. It may not be earlier than ``ctx.timestamp``: the
    stage's output watermark is held there, and an earlier record could reach a window that
    has already fired (the call fails, as a dead letter, instead). ``ts`` may be an aware
    datetime.
    """

    value: Any
    timestamp: Any


class Timers:
    """The key's timers, each named by a tag (setting a tag again moves its timer)."""

    __slots__ = ("_armed", "_hold", "_on")

    def __init__(self, armed: dict[str, Timer], hold: int, on: bool) -> None:
        self._armed = armed
        self._hold = hold
        self._on = on  # the stage has an on_timer function

    def _set(self, domain: str, time: int, tag: str) -> None:
        if not self._on:
            msg = "this process stage sets a timer but has no on_timer function; pass one"
            raise ValueError(msg)
        if isinstance(time, bool) or not isinstance(time, int):
            msg = f"a timer's time is int milliseconds, got {type(time).__name__} {time!r}"
            raise TypeError(msg)
        if not isinstance(tag, str):
            msg = f"a timer's tag is a str, got {type(tag).__name__}"
            raise TypeError(msg)
        self._armed[tag] = Timer(tag, domain, time, self._hold)

    def set_event_time(self, time: int, tag: str = "") -> None:
        """Fire ``on_timer`` once the watermark reaches ``time`` (ms of event time)."""
        self._set(EVENT_TIME, time, tag)

    def set_processing_time(self, time: int, tag: str = "") -> None:
        """Fire ``on_timer`` in the first micro-batch whose time is at least ``time`` (ms)."""
        self._set(PROCESSING_TIME, time, tag)

    def clear(self, tag: str = "") -> None:
        """Cancel the timer named ``tag`` (nothing happens when it is not set)."""
        self._armed.pop(tag, None)

    def get(self, tag: str = "") -> Timer | None:
        """The timer named ``tag``, if it is set."""
        return self._armed.get(tag)

    def __iter__(self) -> Iterator[Timer]:
        return iter(sorted(self._armed.values(), key=lambda t: (t.time, t.tag)))


class Context:
    """What a process or timer function gets besides the key: state, timers, times.

    ``timestamp`` is the event time (ms) of the record being processed (of a firing
    event-time timer: its time); ``watermark`` is the stage's watermark — while elements run,
    the one the micro-batch starts from (the batch before's: an element behind it is late);
    in ``on_timer``, the micro-batch's own, which fired the timer — and ``now`` the
    micro-batch's time (processing time), both ms.
    """

    __slots__ = ("_cells", "_specs", "now", "timers", "timestamp", "watermark")

    def __init__(
        self,
        specs: dict[str, StateSpec[Any]],
        cells: Cells,
        timers: Timers,
        times: tuple[int, int, int],
    ) -> None:
        self._specs = specs
        self._cells = cells
        self.timers = timers
        self.timestamp, self.watermark, self.now = times

    def state(self, spec: StateSpec[H_co]) -> H_co:
        """The handle of ``spec``'s state for this key (declare it in ``states=``)."""
        declared = self._specs.get(spec.name)
        # compared by kind and name: specs reach the workers pickled, as copies
        if declared is None or declared.kind != spec.kind:
            names = ", ".join(sorted(self._specs)) or "none"
            msg = (
                f"state {spec!r} is not declared by this process stage (declared: {names}); "
                "pass it in process(..., states=[...])"
            )
            raise ValueError(msg)
        return spec.bind(self._cells)  # (a combining spec's copy folds as the declared one)


ProcessFn = Callable[[Any, Any, Context], Iterable[Any] | None]
TimerFn = Callable[[Any, Timer, Context], Iterable[Any] | None]


@dataclass(frozen=True)
class ProcessSpec:
    """A process stage's functions, declared state and time-to-live (ms, of batch time)."""

    fn: ProcessFn
    on_timer: TimerFn | None
    states: tuple[StateSpec[Any], ...]
    ttl_ms: int | None = None

    def describe(self) -> str:
        """What the stored state's format depends on (the plan's fingerprint)."""
        parts = [s.describe() for s in self.states]
        if self.ttl_ms is not None:
            parts.append("ttl")
        return "process " + ", ".join(parts)
