"""Declaring a pipeline: ``Pipeline``, ``Stream`` and the transforms.

Every transform takes an explicit stage name first. Names are stable identities: record IDs
and Redis keys are derived from them, so renaming a stage of a running streaming pipeline is a
data-format change (its dedup history and state start over). Names must be unique in a
pipeline and must not contain ``/`` (reserved for names the optimizer derives).

Each transform is a thin wrapper over the optimizer's primitives: map, filter, flat_map,
key_by, map_values, window and merge are flat-maps; combine_per_key and group_by_key are an
exchange followed by a combine (which folds per window when the stream is windowed: the
windowing travels with the stream from ``window`` to the next combine); process is an
exchange followed by a process step.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from onceflow.dedup.config import DedupConfig
from onceflow.graph_optimizer.ir import (
    Combine,
    Each,
    Exchange,
    FlatMap,
    Graph,
    Node,
    Process,
    Sink,
    Source,
    validate,
)
from onceflow.graph_optimizer.lower import lower
from onceflow.graph_optimizer.optimizer import RULES, optimize
from onceflow.kernel.durations import Duration, parse_duration_ms
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.eventtime import EventTime
from onceflow.kernel.limits import RECORD_BYTES
from onceflow.kernel.windows import Trigger, WindowFn, Windowing, windowing
from onceflow.pipeline.combiners import ToList, resolve
from onceflow.pipeline.continuous_joins import interval_join, join_table
from onceflow.pipeline.errors import PipelineError
from onceflow.pipeline.joins import co_group, join
from onceflow.pipeline.key_types import declared_kind
from onceflow.runtime.combine_fn import CombineFn
from onceflow.runtime.driver.run_config import RunConfig
from onceflow.runtime.user_state import ProcessFn, ProcessSpec, StateSpec, TimerFn

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from onceflow.connectors.base import SinkConnector, SourceConnector
    from onceflow.graph_optimizer.plan import Plan
    from onceflow.runtime.driver.result import RunResult
    from onceflow.runtime.spec import Job

_PIPELINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
EXCHANGE_SUFFIX = "/exchange"


def _check_stage_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        msg = f"a stage name must be a non-empty string, got {name!r}"
        raise PipelineError(msg)
    if "/" in name or any(ord(c) < 32 for c in name):
        msg = (
            f"stage name {name!r} contains '/' or a control character; '/' is reserved for "
            "names the optimizer derives - use letters, digits, '-', '_' or '.'"
        )
        raise PipelineError(msg)
    return name


def _check_callable(stage: str, what: str, fn: object) -> None:
    if not callable(fn):
        msg = f"stage {stage!r} needs a function for {what}, got {type(fn).__name__}"
        raise PipelineError(msg)


class Pipeline:
    """A named graph of stages; build it with :meth:`read` and the :class:`Stream` methods.

    ``dead_letters`` is a sink for records that fail (undecodable input, an exception in your
    code, a value too big or not encodable); by default they go to a JSON-lines file
    (bounded runs) or a ``<name>.dead-letters`` Kafka topic (Kafka pipelines). With
    ``on_error="fail"`` such a record stops the run instead. ``dedup`` sets how long
    duplicates are recognised (``DedupConfig.of(horizon="24h")``); ``onceflow gc`` deletes
    dedup history older than that horizon.
    """

    def __init__(
        self,
        name: str,
        *,
        dead_letters: SinkConnector | None = None,
        on_error: str = "dead_letter",
        max_record_bytes: int = RECORD_BYTES,
        dedup: DedupConfig | None = None,
        event_time: EventTime | None = None,
    ) -> None:
        if not isinstance(name, str) or not _PIPELINE_NAME.match(name):
            msg = (
                f"pipeline name {name!r} is not valid: use 1-100 letters, digits, '.', '_' or "
                "'-', starting with a letter or digit (it names Redis keys and Kafka topics)"
            )
            raise PipelineError(msg)
        if on_error not in ("dead_letter", "fail"):
            msg = f"on_error must be 'dead_letter' or 'fail', got {on_error!r}"
            raise PipelineError(msg)
        if max_record_bytes <= 0:
            msg = f"max_record_bytes must be positive, got {max_record_bytes}"
            raise PipelineError(msg)
        dedup = dedup or DedupConfig()
        if dedup.chunk_bytes < max_record_bytes:
            msg = (
                f"DedupConfig.chunk_bytes ({dedup.chunk_bytes}) is below max_record_bytes "
                f"({max_record_bytes}): a record of the largest size allowed could not be "
                "committed; raise chunk_bytes or lower max_record_bytes"
            )
            raise PipelineError(msg)
        self.name = name
        self.dead_letters = dead_letters
        self.on_error = on_error
        self.max_record_bytes = max_record_bytes
        self.dedup = dedup
        self.event_time = event_time or EventTime()
        self._nodes: dict[str, Node] = {}
        self._windows: list[str] = []  # window stages, checked to reach a combine

    # -- building ----------------------------------------------------------------------------

    def _add(self, node: Node) -> str:
        if node.name in self._nodes:
            msg = f"stage {node.name!r} is declared twice; give each stage a unique name"
            raise PipelineError(msg)
        self._nodes[node.name] = node
        return node.name

    def read(self, name: str, source: SourceConnector) -> Stream:
        """Read records from ``source`` (see :mod:`pipeline.sources`)."""
        _check_stage_name(name)
        if not hasattr(source, "decoder"):
            msg = f"stage {name!r}: {source!r} is not a source; use one from pipeline.sources"
            raise PipelineError(msg)
        self._add(Source(name, (), label=source.describe(), connector=source))
        return Stream(self, name, keyed=False)

    def merge(self, name: str, *streams: Stream) -> Stream:
        """One stream with the elements of all ``streams``."""
        _check_stage_name(name)
        if len(streams) < 2:
            msg = f"merge {name!r} needs at least two streams, got {len(streams)}"
            raise PipelineError(msg)
        for s in streams:
            if s.pipeline is not self:
                msg = f"merge {name!r}: stream {s.name!r} belongs to another pipeline"
                raise PipelineError(msg)
        keyed = {s.keyed for s in streams}
        if len(keyed) > 1:
            names = ", ".join(f"{s.name!r} ({'keyed' if s.keyed else 'unkeyed'})" for s in streams)
            msg = f"merge {name!r} mixes keyed and unkeyed streams: {names}; key them alike"
            raise PipelineError(msg)
        windowings = {s.windowing for s in streams}
        if len(windowings) > 1:
            msg = f"merge {name!r} mixes streams windowed differently; window them alike"
            raise PipelineError(msg)
        node = FlatMap(name, tuple(s.name for s in streams), label="merge", each=Each.PASS)
        self._add(node)
        return Stream(self, name, keyed=keyed.pop(), windowing=windowings.pop())

    # -- inspecting and running --------------------------------------------------------------

    @property
    def graph(self) -> Graph:
        """The validated logical graph."""
        graph = validate(Graph(self.name, tuple(self._nodes.values())))
        for window in self._windows:
            _check_combined(graph, window)
        return graph

    def plan(self, rules: Iterable[Callable[[Plan], Plan]] | None = None) -> Plan:
        """The physical plan, optimized with ``rules`` (all rules by default, () for none)."""
        return optimize(self.graph, tuple(RULES if rules is None else rules))

    def job(self, rules: Iterable[Callable[[Plan], Plan]] | None = None) -> Job:
        """The runtime's job for the plan optimized with ``rules``."""
        return lower(
            self.plan(rules),
            on_error=self.on_error,
            max_record_bytes=self.max_record_bytes,
            dead_letters=self.dead_letters,
            dedup=self.dedup,
            event_time=self.event_time,
        )

    def run(
        self,
        rules: Iterable[Callable[[Plan], Plan]] | None = None,
        *,
        session: SparkSession | None = None,
        config: RunConfig | None = None,
        **settings: Any,
    ) -> RunResult:
        """Run the pipeline: bounded when every source ends, else a streaming query.

        ``rules`` picks optimizer rules (default: all; ``()`` runs the unoptimized plan);
        ``session`` is a SparkSession to run on instead of starting one. The settings are those
        of :class:`~onceflow.runtime.driver.run_config.RunConfig` (``master``, ``redis_url``,
        ``guarantee`` ...): given as ``config``, as keywords, or both (keywords win). A name it
        does not know is an error naming the closest one it knows, before anything starts.
        """
        from onceflow.runtime.driver.runner import run

        if config is None:
            config = RunConfig.from_settings(settings)
        elif settings:
            config = config.replace(**settings)
        return run(self.job(rules), config, session)

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, {len(self._nodes)} stages)"


def _check_combined(graph: Graph, window: str) -> None:
    """Refuse a window whose records reach a sink, or nothing, without a combine on the way.

    A window only tells the combine after it to fold per window and emit panes; without one
    it would silently do nothing (the optimizer sees an identity step there, and windows
    only as a Combine's ``windowing``). Element-wise steps in between are fine.
    """
    todo, seen = [window], {window}
    while todo:
        name = todo.pop()
        readers = graph.consumers[name]
        if isinstance(graph[name], Combine):
            continue
        if isinstance(graph[name], Sink):
            problem = f"sink {name!r} gets its records without one"
        elif not readers:
            problem = f"nothing reads {name!r}"
        else:
            fresh = [r for r in readers if r not in seen]
            seen.update(fresh)
            todo += fresh
            continue
        msg = (
            f"window {window!r} only acts in a combine after it, but {problem}; add "
            f".combine_per_key(...), .count_per_key(...) or .group_by_key(...) after {window!r}"
        )
        raise PipelineError(msg)


def _fn_name(fn: object) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return "lambda" if name is None or "<lambda>" in name else str(name)


def _ttl_ms(name: str, ttl: Duration, what: str = "combine_per_key") -> int:
    try:
        ms = parse_duration_ms(ttl, "ttl")
    except ConfigError as exc:
        msg = f"{what} {name!r}: {exc}"
        raise PipelineError(msg) from None
    if ms <= 0:
        msg = f"{what} {name!r}: ttl must be a positive duration, got {ttl!r}"
        raise PipelineError(msg)
    return ms


def _check_states(name: str, states: Iterable[StateSpec[Any]]) -> tuple[StateSpec[Any], ...]:
    specs = tuple(states)
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, StateSpec):
            msg = (
                f"process {name!r}: states= takes ValueSpec, BagSpec, MapSpec or CombiningSpec "
                f"(from onceflow.state), got {type(spec).__name__}"
            )
            raise PipelineError(msg)
        if spec.name in seen:
            msg = f"process {name!r} declares state {spec.name!r} twice; name each state once"
            raise PipelineError(msg)
        seen.add(spec.name)
    return specs


class Stream:
    """The output of a stage; call transforms on it to add stages that read it.

    Elements of a keyed stream are ``(key, value)`` tuples.
    """

    def __init__(
        self, pipeline: Pipeline, name: str, keyed: bool, windowing: Windowing | None = None
    ) -> None:
        self.pipeline = pipeline
        self.name = name
        self.keyed = keyed
        self.windowing = windowing  # set by window(); element-wise steps keep it
        # what key_by's function says it returns (see onceflow.pipeline.key_types); steps
        # that keep the key keep it
        self.key_kind: str | None = None

    def _flat(
        self,
        name: str,
        label: str,
        fn: Callable[..., Any] | None,
        keyed: bool | None,
        user_fn: object = None,
        timestamped: bool = False,
        restamp: bool = False,
        each: Each = Each.FLAT,
    ) -> Stream:
        _check_stage_name(name)
        if user_fn is not None:
            label = f"{label} {_fn_name(user_fn)}"
        node = FlatMap(
            name,
            (self.name,),
            label=label,
            fn=fn,
            keyed=keyed,
            timestamped=timestamped,
            restamp=restamp,
            each=each,
        )
        self.pipeline._add(node)
        stream = Stream(self.pipeline, name, self.keyed if keyed is None else keyed, self.windowing)
        if stream.keyed and keyed is not False:
            stream.key_kind = self.key_kind
        return stream

    def map(self, name: str, fn: Callable[[Any], Any]) -> Stream:
        """One output per element: ``fn(element)``. The result is unkeyed."""
        _check_callable(name, "map", fn)
        return self._flat(name, "map", fn, keyed=False, user_fn=fn, each=Each.MAP)

    def flat_map(self, name: str, fn: Callable[[Any], Iterable[Any]]) -> Stream:
        """Zero or more outputs per element: the items of ``fn(element)``. Unkeyed."""
        _check_callable(name, "flat_map", fn)
        return self._flat(name, "flat_map", fn, keyed=False, user_fn=fn)

    def map_timestamped(self, name: str, fn: Callable[[Any, int], Any]) -> Stream:
        """``fn(element, event_time_ms)``: a map that reads each record's event time.

        The output keeps the record's event time. Unkeyed, as :meth:`map`.
        """
        _check_callable(name, "map_timestamped", fn)
        return self._flat(
            name,
            "map_timestamped",
            fn,
            keyed=False,
            user_fn=fn,
            timestamped=True,
            each=Each.MAP,
        )

    def restamp(self, name: str, fn: Callable[[Any], Any]) -> Stream:
        """Give each element the event time ``fn(element)`` (epoch ms, or an aware datetime).

        The element is passed on unchanged, keyed and windowed as it was; windows after this
        step place it by its new time. The watermark still follows the sources' event
        times: an element stamped behind it (minus the window's allowed lateness) is late for
        its windows, and one stamped further ahead of the clock than ``EventTime.max_ahead``
        is not processed; both become dead letters with the reason, as a failing ``fn``'s
        element does.
        """
        _check_callable(name, "restamp", fn)
        return self._flat(name, "restamp", fn, keyed=None, user_fn=fn, restamp=True)

    def filter(self, name: str, predicate: Callable[[Any], bool]) -> Stream:
        """Keep the elements for which ``predicate`` is true (keyedness is kept)."""
        _check_callable(name, "filter", predicate)
        return self._flat(
            name, "filter", predicate, keyed=None, user_fn=predicate, each=Each.FILTER
        )

    def key_by(self, name: str, key_fn: Callable[[Any], Any]) -> Stream:
        """Key each element: outputs ``(key_fn(element), element)``."""
        _check_callable(name, "key_by", key_fn)
        stream = self._flat(name, "key_by", key_fn, keyed=True, user_fn=key_fn, each=Each.KEY_BY)
        stream.key_kind = declared_kind(key_fn)
        return stream

    def map_values(self, name: str, fn: Callable[[Any], Any]) -> Stream:
        """On a keyed stream: ``(key, fn(value))``, still keyed."""
        self._need_keyed(name, "map_values")
        _check_callable(name, "map_values", fn)
        return self._flat(name, "map_values", fn, keyed=True, user_fn=fn, each=Each.MAP_VALUES)

    def window(
        self,
        name: str,
        windows: WindowFn | Duration,
        *,
        trigger: Trigger | None = None,
        allowed_lateness: Duration = 0,
        accumulation: str = "accumulating",
    ) -> Stream:
        """Window a keyed stream by event time; the next ``combine_per_key`` folds per window.

        ``windows`` is :class:`~onceflow.windows.Fixed`, :class:`~onceflow.windows.Sliding`,
        :class:`~onceflow.windows.Sessions` or :class:`~onceflow.windows.Global` (a number or
        ``"1m"`` means fixed windows of that size). The combine then emits ``(key, Pane)``:
        the result with its window's bounds and why it fired (see :mod:`onceflow.windows`).
        By default one pane per window when the watermark passes its end; ``trigger`` adds
        early and late panes, ``allowed_lateness`` keeps a window open for late records that
        long past its end (later ones go to dead letters), ``accumulation="discarding"``
        makes each pane carry only what came since the previous one.
        """
        self._need_keyed(name, "window")
        try:
            spec = windowing(
                windows,
                trigger=trigger,
                allowed_lateness=allowed_lateness,
                accumulation=accumulation,
            )
        except ConfigError as exc:
            msg = f"window {name!r}: {exc}"
            raise PipelineError(msg) from None
        stream = self._flat(name, spec.describe(), None, keyed=True, each=Each.PASS)
        stream.windowing = spec
        self.pipeline._windows.append(name)
        return stream

    def combine_per_key(
        self,
        name: str,
        combiner: CombineFn | str,
        *,
        ttl: Duration | None = None,
        on_expiry: str = "forget",
    ) -> Stream:
        """Fold the values of each key: ``(key, result)``.

        ``combiner`` is a :class:`~pipeline.combiners.CombineFn` or the name of a built-in:
        ``sum``, ``count``, ``min``, ``max``, ``mean``, ``list``. On a windowed stream (see
        :meth:`window`) it folds per key and window and emits ``(key, Pane)``. Otherwise, in
        a streaming run, the result is updated every micro-batch and emitted for the keys
        that changed; ``ttl`` (``"7d"``, or seconds) forgets a key's state once it has not
        changed for that long (processing time), so state of keys that stop appearing does
        not stay in Redis forever (``onceflow gc`` reclaims it). ``on_expiry="delete"``
        sends ``(key, None)`` on when a key's state expires, exactly once, and deletes the
        state itself (not left to ``onceflow gc``): a sink downstream deletes the key's row
        (a PostgreSQL upsert) or writes a tombstone (Kafka).
        """
        _check_stage_name(name)
        self._need_keyed(name, "combine_per_key")
        fn = resolve(combiner)
        ttl_ms = None
        if ttl is not None:
            if self.windowing is not None:
                msg = (
                    f"combine_per_key {name!r}: ttl applies to unwindowed state; a windowed "
                    "combine's state ends when its windows close (set allowed_lateness)"
                )
                raise PipelineError(msg)
            ttl_ms = _ttl_ms(name, ttl)
        if on_expiry not in ("forget", "delete"):
            msg = (
                f"combine_per_key {name!r}: on_expiry must be 'forget' or 'delete', "
                f"got {on_expiry!r}"
            )
            raise PipelineError(msg)
        if on_expiry == "delete" and ttl_ms is None:
            msg = f"combine_per_key {name!r}: on_expiry='delete' needs a ttl"
            raise PipelineError(msg)
        exchange = name + EXCHANGE_SUFFIX
        self.pipeline._add(Exchange(exchange, (self.name,), label="exchange by key"))
        self.pipeline._add(
            Combine(
                name,
                (exchange,),
                label=fn.label,
                combine_fn=fn,
                windowing=self.windowing,
                ttl_ms=ttl_ms,
                expiry_deletes=on_expiry == "delete",
            )
        )
        stream = Stream(self.pipeline, name, keyed=True)
        stream.key_kind = self.key_kind
        return stream

    def process(
        self,
        name: str,
        fn: ProcessFn,
        *,
        states: Iterable[StateSpec[Any]] = (),
        on_timer: TimerFn | None = None,
        state_ttl: Duration | None = None,
    ) -> Stream:
        """Run ``fn(key, value, ctx)`` on each element with the key's own state and timers.

        ``states`` declares the state kept per key (:mod:`onceflow.state` specs: value, bag,
        map, combining); ``ctx.state(spec)`` reads and changes it, ``ctx.timers`` sets
        event-time and processing-time timers, which call ``on_timer(key, timer, ctx)``.
        Both functions return (or yield) their outputs; the result is unkeyed. State changes,
        timer firings and outputs are committed together, exactly once. ``state_ttl``
        (``"30d"``, or seconds) forgets a key's state (and its timers) that long after its
        last change, in processing time. See docs/guide/state.md.
        """
        _check_stage_name(name)
        self._need_keyed(name, "process")
        _check_callable(name, "process", fn)
        if on_timer is not None:
            _check_callable(name, "on_timer", on_timer)
        if self.windowing is not None:
            msg = (
                f"process {name!r} reads a windowed stream; windows act in combines only: "
                "keep per-key state and set timers in the process function instead"
            )
            raise PipelineError(msg)
        ttl_ms = _ttl_ms(name, state_ttl, "process") if state_ttl is not None else None
        spec = ProcessSpec(fn, on_timer, _check_states(name, states), ttl_ms)
        exchange = name + EXCHANGE_SUFFIX
        self.pipeline._add(Exchange(exchange, (self.name,), label="exchange by key"))
        self.pipeline._add(
            Process(name, (exchange,), label=f"process {_fn_name(fn)}", process=spec)
        )
        return Stream(self.pipeline, name, keyed=False)

    def count_per_key(self, name: str) -> Stream:
        """``combine_per_key(name, "count")``."""
        return self.combine_per_key(name, "count")

    def group_by_key(self, name: str) -> Stream:
        """All values of each key in a list: ``(key, [values])``."""
        return self.combine_per_key(name, ToList())

    def co_group(self, name: str, other: Stream, windows: WindowFn | Duration) -> Stream:
        """Both keyed streams' values per key and window: ``(key, CoGroup(left, right, ...))``.

        See :mod:`onceflow.pipeline.joins` (state, lateness, exactly-once).
        """
        grouped: Stream = co_group(self, name, other, windows)
        return grouped

    def join(
        self, name: str, other: Stream, windows: WindowFn | Duration, *, how: str = "inner"
    ) -> Stream:
        """Pairs of one key's values in one window: ``(key, (this value, other value))``.

        ``how``: ``"inner"``, ``"left"``, ``"right"`` or ``"outer"`` (a value with no partner
        in its window is paired with None). See :mod:`onceflow.pipeline.joins`.
        """
        joined: Stream = join(self, name, other, windows, how)
        return joined

    def interval_join(self, name: str, other: Stream, lower: Duration, upper: Duration) -> Stream:
        """Pairs of one key's values close in event time: ``(key, (this, other))``.

        ``this.ts + lower <= other.ts <= this.ts + upper`` (seconds or ``"5s"``; negative
        allowed). Not windowed: each side is kept until the watermark passes the last time a
        partner can have. See :mod:`onceflow.pipeline.continuous_joins`.
        """
        joined: Stream = interval_join(self, name, other, lower, upper)
        return joined

    def join_table(self, name: str, table: Stream, *, how: str = "left") -> Stream:
        """Each value with the table's row for its key as of its time: ``(key, (value, row))``.

        ``table`` holds versions of each key's row (e.g. a compacted topic; a None row deletes
        it). ``how="inner"`` leaves out values with no row. See
        :mod:`onceflow.pipeline.continuous_joins`.
        """
        joined: Stream = join_table(self, name, table, how)
        return joined

    def write(self, name: str, sink: SinkConnector) -> None:
        """Write the elements to ``sink`` (see :mod:`pipeline.sinks`)."""
        _check_stage_name(name)
        if not hasattr(sink, "open") or not hasattr(sink, "to_driver"):
            msg = f"stage {name!r}: {sink!r} is not a sink; use one from pipeline.sinks"
            raise PipelineError(msg)
        self.pipeline._add(Sink(name, (self.name,), label=sink.describe(), connector=sink))

    def _need_keyed(self, name: str, what: str) -> None:
        if not self.keyed:
            msg = (
                f"{what} {name!r} needs a keyed stream but {self.name!r} is not keyed; "
                f"add .key_by(...) before {name!r}"
            )
            raise PipelineError(msg)

    def __repr__(self) -> str:
        return f"Stream({self.name!r}{', keyed' if self.keyed else ''})"
