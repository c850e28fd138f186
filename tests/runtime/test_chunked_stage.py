"""A fused stage run a chunk at a time makes what running one element at a time made.

Random stages (maps, filters, flat maps, key_by, map_values, timestamped maps, restamps,
pass-throughs, a combine; fan-outs, merges of two producers, two inbounds, records replayed
from dead letters) with functions that sometimes raise (``StopIteration`` too) run through
:class:`~onceflow.runtime.ops.body.StageBody` and through :class:`ElementByElement` below, the
per-record dispatch the stage had before it ran chunks (pushes depth first, element by
element). Outputs, their order and IDs, the dead letters (and their order and IDs) and the
counts must be the same; with ``on_error="fail"``, the same first failure.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest

from onceflow.kernel import codec
from onceflow.kernel.eventtime import as_event_time
from onceflow.kernel.records import Guarantee, InRow, Output, Redrive
from onceflow.runtime.ops.body import StageBody
from onceflow.runtime.ops.boundaries import Boundaries
from onceflow.runtime.ops.combine import CombineOp
from onceflow.runtime.ops.combine_flush import CombineFlush
from onceflow.runtime.ops.record_text import (
    Cursor,
    StageFailure,
    ahead_reason,
    as_json,
    describe,
    error_text,
    portable,
)
from onceflow.runtime.spec import (
    Each,
    InboundSpec,
    OpKind,
    OpSpec,
    StageSpec,
    TargetKind,
    TargetSpec,
)
from tests.runtime import chunk_fns as fns

LIMIT_MS = 10**12
Push = Callable[[Any], None]

# -- the stage as it ran element by element (the reference) ---------------------------------


class ElementByElement:
    """The stage's ops wired push-style, each element pushed through them depth first."""

    def __init__(self, spec: StageSpec, mode: Guarantee) -> None:
        self.spec = spec
        self.mode = mode
        self.cursor = Cursor()
        self.out = Boundaries(spec, mode.ids, self.cursor, self._origin)
        self.combines: dict[str, CombineOp] = {}
        self.push: dict[str, Push] = {}
        for op in reversed(spec.ops):  # consumers first
            self.push[op.name] = self._build(op)
        self.entries = [
            self._fan(
                [self.push[n] for n in i.entries] + [self._append(t) for t in i.entry_targets]
            )
            for i in spec.inbound
        ]
        self.dispatch = [self._dispatcher(i) for i in spec.inbound]

    def _origin(self, parent: bytes) -> str:
        return f"record {parent.hex()} (batch 1 partition 0)" if parent else "batch 1 partition 0"

    def _fan(self, pushes: list[Push]) -> Push:
        def fan(elem: Any) -> None:
            for p in pushes:
                p(elem)

        return fan

    def _downstream(self, op: OpSpec) -> Push:
        return self._fan(
            [self.push[n] for n in op.to_ops] + [self._append(t) for t in op.to_targets]
        )

    def _append(self, target: int) -> Push:
        cursor, out = self.cursor, self.out
        return lambda elem: out.add(target, [elem], [cursor.parent], [cursor.ts])

    def _build(self, op: OpSpec) -> Push:
        if op.kind is OpKind.COMBINE:
            self.combines[op.name] = CombineOp(op, self.mode.streaming, False, None)
            return self._adder(self.combines[op.name])
        out = self._downstream(op)
        if op.restamp:
            return self._restamp(op, out)
        cursor, name = self.cursor, op.name

        def push(elem: Any) -> None:
            try:
                results = _outputs(op, elem, cursor.ts)
                if not isinstance(results, tuple | list):
                    results = list(results)
            except Exception as exc:
                self.fail(name, exc, elem)
                return
            for r in results:
                out(r)

        return push

    def _restamp(self, op: OpSpec, out: Push) -> Push:
        cursor, name, fn = self.cursor, op.name, op.fn
        assert fn is not None

        def push(elem: Any) -> None:
            try:
                ts = as_event_time(fn(elem))
            except Exception as exc:
                self.fail(name, exc, elem)
                return
            if ts > LIMIT_MS:
                self.out.letter(name, ahead_reason(ts, LIMIT_MS), portable(elem), "ahead")
                return
            old = cursor.ts
            cursor.ts = ts
            try:
                out(elem)
            finally:
                cursor.ts = old

        return push

    def _adder(self, combine: CombineOp) -> Callable[..., None]:
        cursor, name = self.cursor, combine.spec.name

        def push(elem: Any, kb: bytes | None = None) -> None:
            try:
                key, value = elem
                combine.add(kb if kb is not None else codec.encode(key), key, value, cursor.ts)
            except Exception as exc:
                self.fail(name, exc, elem)

        return push

    def _dispatcher(self, inbound: InboundSpec) -> Callable[[Any, bytes | None], None]:
        entry = self.entries[inbound.index]
        combine = self.combines.get(inbound.entries[0]) if len(inbound.entries) == 1 else None
        if combine is None or inbound.entry_targets:
            return lambda elem, _kb: entry(elem)
        return self._adder(combine)

    def fail(self, node: str, exc: BaseException, elem: Any) -> None:
        if self.spec.on_error == "fail":
            msg = f"stage {node!r} failed on {describe(elem, 200)}: {error_text(exc)}"
            raise StageFailure(msg) from exc
        value, replayable = as_json(elem)
        self.out.letter(node, error_text(exc), value, "user_error", json_value=replayable)

    def run(self, rows: list[InRow]) -> None:
        cursor = self.cursor
        for inbound, rid, ts, kb, elem in rows:
            cursor.parent, cursor.ts = rid, ts
            if elem.__class__ is Redrive:
                push = self.push.get(elem.node)
                if push is None:
                    self.out.unroutable(self.spec.name, elem)
                else:
                    push(elem.value)
                continue
            self.dispatch[inbound](elem, kb)

    def flush_end(self) -> None:
        flush = CombineFlush(
            self.spec,
            self.combines,
            {},
            self.cursor,
            (0, 0, None, None),
            self._downstream,
            self.fail,
            nullcontext,
        )
        flush.flush_end(None)


def _outputs(op: OpSpec, x: Any, ts: int) -> Any:
    """What the element-wise op made of one element, as the stage's wrappers called it."""
    fn = op.fn
    if op.each is Each.PASS:
        return (x,)
    assert fn is not None
    if op.each is Each.MAP:
        return (fn(x, ts),) if op.timestamped else (fn(x),)
    if op.each is Each.FILTER:
        return (x,) if fn(x) else ()
    if op.each is Each.KEY_BY:
        return ((fn(x), x),)
    if op.each is Each.MAP_VALUES:
        return ((x[0], fn(x[1])),)
    return fn(x, ts) if op.timestamped else fn(x)


# -- random stages ---------------------------------------------------------------------------

FORMS = ("map", "filter", "flat", "key_by", "map_values", "pass", "map_ts", "restamp", "combine")


def random_stage(rng: random.Random) -> StageSpec:
    """A stage of random ops, producers and targets (see the module docstring)."""
    inbounds = 1 if rng.random() < 0.75 else 2
    keyed = [rng.random() < 0.3 for _ in range(inbounds)]
    n_targets = rng.randint(1, 3)
    n_ops = rng.randint(1, 6)
    names = [f"op{j}" for j in range(n_ops)]
    entries: list[list[str]] = [[] for _ in range(inbounds)]
    entry_targets: list[list[int]] = [[] for _ in range(inbounds)]
    to_ops: list[list[str]] = [[] for _ in range(n_ops)]
    to_targets: list[list[int]] = [[] for _ in range(n_ops)]
    for j in range(n_ops):  # one producer each, sometimes two (a merge)
        producers = rng.sample(range(-inbounds, j), min(j + inbounds, rng.choice((1, 1, 1, 2))))
        for p in producers:
            (entries[-1 - p] if p < 0 else to_ops[p]).append(names[j])
    for t in range(n_targets):  # a writer each, sometimes two
        for p in rng.sample(range(-inbounds, n_ops), min(n_ops + inbounds, rng.choice((1, 1, 2)))):
            (entry_targets[-1 - p] if p < 0 else to_targets[p]).append(t)
    for lists in (*entries, *to_ops):
        rng.shuffle(lists)  # the order producers push in
    ops = tuple(_op(rng, names[j], to_ops[j], to_targets[j]) for j in range(n_ops))
    targets = [
        TargetSpec(t, TargetKind.SINK, f"sink{t}", rng.random() < 0.4) for t in range(n_targets)
    ]
    targets.append(TargetSpec(n_targets, TargetKind.DEAD, "dead-letters", False))
    return StageSpec(
        pipeline="p",
        name="stage",
        ops=ops,
        inbound=tuple(
            InboundSpec(i, keyed[i], tuple(entries[i]), tuple(entry_targets[i]))
            for i in range(inbounds)
        ),
        targets=tuple(targets),
        source="src" if inbounds == 1 and not keyed[0] else None,
        on_error="fail" if rng.random() < 0.1 else "dead_letter",
    )


def _op(rng: random.Random, name: str, to_ops: list[str], to_targets: list[int]) -> OpSpec:
    form = rng.choice(FORMS)
    bad = (rng.choice((0, 4, 6, 9)), rng.randrange(4))
    common = {"name": name, "to_ops": tuple(to_ops), "to_targets": tuple(to_targets)}
    if form == "combine":
        return OpSpec(kind=OpKind.COMBINE, combine_fn=fns.Picky(rng.randrange(7)), **common)
    kind = OpKind.FLAT_MAP
    if form == "map":
        return OpSpec(kind=kind, fn=fns.mapper(rng.randint(1, 3), bad), each=Each.MAP, **common)
    if form == "map_ts":
        return OpSpec(kind=kind, fn=fns.timestamped(bad), each=Each.MAP, timestamped=True, **common)
    if form == "filter":
        return OpSpec(
            kind=kind, fn=fns.predicate(rng.randrange(3), bad), each=Each.FILTER, **common
        )
    if form == "key_by":
        return OpSpec(kind=kind, fn=fns.key_of(rng.randint(1, 4), bad), each=Each.KEY_BY, **common)
    if form == "map_values":
        fn = fns.mapper(rng.randint(1, 3), bad)
        return OpSpec(kind=kind, fn=fn, each=Each.MAP_VALUES, **common)
    if form == "pass":
        return OpSpec(kind=kind, each=Each.PASS, **common)
    if form == "restamp":
        return OpSpec(kind=kind, fn=fns.stamp(bad), restamp=True, **common)
    return OpSpec(kind=kind, fn=fns.flat(bad), **common)


def random_rows(rng: random.Random, spec: StageSpec, ids: bool = True) -> list[InRow]:
    """Rows for the stage: some share their parent's ID, some are no pairs, some replayed.

    Without ``ids`` (a bounded run) every row's ID is empty.
    """
    rows: list[InRow] = []
    for _ in range(rng.randint(0, 40)):
        inbound = rng.randrange(len(spec.inbound))
        rid = rows[-1][1] if rows and rng.random() < 0.1 else rng.randbytes(16)
        rid = rid if ids else b""
        ts = rng.randrange(5000)
        elem: Any = rng.randrange(200)
        kb = None
        if spec.inbound[inbound].keyed and rng.random() < 0.9:
            elem = (rng.randrange(5), elem)
            kb = codec.encode(elem[0])
        if spec.source is not None and rng.random() < 0.05:
            node = rng.choice([*(op.name for op in spec.ops), "nowhere"])
            elem = Redrive(node, rng.randrange(200))
        rows.append((inbound, rid, ts, kb, elem))
    return rows


# -- the comparison --------------------------------------------------------------------------

_AT = re.compile(r" \(at ([^)]*):\d+\)")


def _where(text: str) -> str:
    """Error text with the place it names kept only if it is the user's (chunk_fns.py)."""
    return _AT.sub(lambda m: m.group(0) if m.group(1).endswith("chunk_fns.py") else "", text)


def _comparable(spec: StageSpec, outputs: list[Output]) -> list[Any]:
    found = []
    for o in outputs:
        if o.target == spec.dead_target:
            letter = codec.decode(o.value)
            letter["error"] = _where(letter["error"])
            found.append((o.target, o.id, o.ts, letter))
        else:
            found.append(o)
    return found


def _run(runner: Any, rows: list[InRow], spec: StageSpec) -> tuple[Any, ...]:
    """What a run of the rows made (and, bounded, what the end of the task emitted)."""
    try:
        runner.run(rows)
        made = [_comparable(spec, runner.out.take())]
        if isinstance(runner, StageBody) and not runner.mode.streaming:
            runner.flush_end(None)
        elif not runner.mode.streaming:
            runner.flush_end()
        made.append(_comparable(spec, runner.out.take()))
    except StageFailure as failure:
        return ("failed", _where(str(failure)), runner.cursor.parent)
    folded = {name: c.acc for name, c in runner.combines.items()}
    return (*made, folded, runner.out.dead_count, runner.out.dead_codes)


@pytest.mark.parametrize("mode", [Guarantee.EXACTLY_ONCE, Guarantee.BOUNDED])
def test_chunks_make_what_elements_made(mode: Guarantee) -> None:
    """The property of the module docstring, over many random stages and chunks."""
    for seed in range(600):
        rng = random.Random(seed)
        spec = random_stage(rng)
        rows = random_rows(rng, spec, mode.ids)
        body = StageBody(spec, mode, 1, 0)
        body.limit_ms = LIMIT_MS
        expected = _run(ElementByElement(spec, mode), rows, spec)
        assert _run(body, rows, spec) == expected, f"seed {seed}: {spec}"


def test_a_function_raising_stop_iteration_fails_its_element_only() -> None:
    """``StopIteration`` out of a user's function ends a ``map`` quietly; the chunk must not
    end there: the element is a dead letter, the rest go on."""

    def stop_at_two(x: int) -> int:
        if x == 2:
            raise StopIteration
        return x * 10

    sink = TargetSpec(0, TargetKind.SINK, "out", False)
    dead = TargetSpec(1, TargetKind.DEAD, "dead-letters", False)
    spec = StageSpec(
        "p",
        "s",
        (OpSpec("m", OpKind.FLAT_MAP, (), (0,), fn=stop_at_two, each=Each.MAP),),
        (InboundSpec(0, False, ("m",), ()),),
        (sink, dead),
    )
    body = StageBody(spec, Guarantee.BOUNDED, 0, 0)
    body.run([(0, b"", ts, None, x) for ts, x in enumerate([1, 2, 3, 4])])
    out = body.take()
    assert [codec.decode(o.value) for o in out if o.target == 0] == [10, 30, 40]
    letters = [codec.decode(o.value) for o in out if o.target == 1]
    assert [x["error"].split(" (at")[0] for x in letters] == ["StopIteration: "]


def test_letters_keep_their_place_in_the_order() -> None:
    """Two ops fail on the same record: its letters come in the order an element-by-element
    run made them (and so get the same IDs), though each op runs the whole chunk in turn."""

    def fails_odd(x: int) -> int:
        if x % 2:
            raise ValueError(x)
        return x

    def fails_small(x: int) -> int:
        if x < 3:
            raise KeyError(x)
        return x

    dead = TargetSpec(0, TargetKind.DEAD, "dead-letters", False)
    spec = StageSpec(
        "p",
        "s",
        (
            OpSpec("a", OpKind.FLAT_MAP, (), (), fn=fails_odd, each=Each.MAP),
            OpSpec("b", OpKind.FLAT_MAP, (), (), fn=fails_small, each=Each.MAP),
        ),
        (InboundSpec(0, False, ("b", "a"), ()),),
        (dead,),
    )
    rows: list[InRow] = [(0, bytes([x]) * 16, x, None, x) for x in range(5)]
    body = StageBody(spec, Guarantee.EXACTLY_ONCE, 0, 0)
    body.run(rows)
    letters = [(o.id, codec.decode(o.value)) for o in body.take()]
    assert [(x["stage"], x["value"]) for _, x in letters] == [
        ("b", "0"),
        ("b", "1"),
        ("a", "1"),
        ("b", "2"),
        ("a", "3"),
    ]
    reference = ElementByElement(spec, Guarantee.EXACTLY_ONCE)
    reference.run(rows)
    assert [o.id for o in reference.out.take()] == [rid for rid, _ in letters]


def test_a_letter_names_the_users_line_never_the_runtimes() -> None:
    """The place a dead letter names is the user's code; a function written in C that raised
    (``int`` on a word) has none, rather than a line of the loop that called it."""
    sink = TargetSpec(0, TargetKind.SINK, "out", False)
    dead = TargetSpec(1, TargetKind.DEAD, "dead-letters", False)
    ops = (
        OpSpec("parse", OpKind.FLAT_MAP, ("check",), (), fn=int, each=Each.MAP),
        OpSpec("check", OpKind.FLAT_MAP, (), (0,), fn=fns.mapper(1, (5, 0)), each=Each.MAP),
    )
    spec = StageSpec("p", "s", ops, (InboundSpec(0, False, ("parse",), ()),), (sink, dead))
    body = StageBody(spec, Guarantee.BOUNDED, 0, 0)
    body.run([(0, b"", 0, None, "x"), (0, b"", 0, None, "10")])
    errors = [codec.decode(o.value)["error"] for o in body.take() if o.target == 1]
    assert errors[0] == "ValueError: invalid literal for int() with base 10: 'x'"
    assert errors[1].startswith("ValueError: bad element 10 (at ")
    assert errors[1].split(" (at ")[1].split(":")[0].endswith("chunk_fns.py")


def test_a_target_encoded_at_once_is_what_encoding_each_element_made() -> None:
    """Outputs encoded and their IDs derived a target at a time are those of encoding each
    element (IDs numbered among a parent's outputs); whatever would fail one by one
    (an unencodable value, a non-pair on a keyed target, a value too large) is left to it."""
    fast = 0
    for seed in range(300):
        rng = random.Random(seed)
        keyed = rng.random() < 0.5
        target = TargetSpec(0, TargetKind.SINK, "out", keyed)
        dead = TargetSpec(1, TargetKind.DEAD, "dead-letters", False)
        spec = StageSpec("p", "s", (), (), (target, dead), max_record_bytes=rng.choice((40, 10**6)))
        parents = [rng.choice((b"a" * 16, b"b" * 16, rng.randbytes(16))) for _ in range(30)]
        elems: list[Any] = [
            (rng.randrange(9), ("v", rng.randrange(10 ** rng.randrange(1, 12))))
            if keyed
            else rng.choice((rng.randrange(100), "x" * rng.randrange(60), (1, 2.5), [None]))
            for _ in parents
        ]
        if rng.random() < 0.2:
            elems[rng.randrange(len(elems))] = rng.choice((object(), 7, 2**70))
        made = []
        for each in (True, False):
            out = Boundaries(spec, True, Cursor(), lambda parent: "here")
            out.add(0, elems, parents, list(range(len(elems))))
            found: list[Output] | None = []
            if each:
                out._encode_each(target, out.buffers[0], found)  # type: ignore[arg-type]
            else:
                found = out._encode_all(target, out.buffers[0])
            made.append((found, out.buffers[1].elems))
        (one_by_one, letters), (at_once, _) = made
        if at_once is not None:
            fast += 1
            assert at_once == one_by_one and not letters, f"seed {seed}"
    assert fast > 150
