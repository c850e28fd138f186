"""A sink writes the elements a stage made only where they are what its backup decodes to.

The first attempt writes sink records from the elements the stage still holds; a retry writes
them from the backup, decoded. Both must be the same records, of the same types, and a Kafka
sink must make the same bytes of them: an element that is not made of plain values (a tuple, a
dict subclass, a dataclass), or that was changed after it was encoded, is decoded as before.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from onceflow.connectors.kafka.sink import KafkaSink
from onceflow.kernel import record_types
from onceflow.kernel.records import Guarantee, Output, Record, TaskRef
from onceflow.runtime.guard import NoGuard
from onceflow.runtime.ops.body import StageBody
from onceflow.runtime.ops.boundaries import Boundaries
from onceflow.runtime.ops.made import decode_outputs
from onceflow.runtime.ops.record_text import Cursor
from onceflow.runtime.spec import StageSpec, TargetKind, TargetSpec
from onceflow.runtime.task.sink_delivery import SinkDelivery


@dataclass
class Bid:
    user: str
    price: float


def _typed(value: Any) -> Any:
    """A value with the type of every part spelt out (== alone says 1 == 1.0 == True)."""
    if isinstance(value, dict):
        return (type(value), [(_typed(k), _typed(v)) for k, v in value.items()])
    if isinstance(value, list | tuple):
        return (type(value), [_typed(v) for v in value])
    return (type(value), value)


def _element(rng: random.Random, keyed: bool) -> Any:
    plain = rng.choice(
        [
            {"user": f"u{rng.randrange(9)}", "price": rng.random() * 100, "n": rng.randrange(9)},
            [1, "two", 3.0, None, True, b"\x00"],
            rng.randrange(-(2**63), 2**63),
            {"nested": {"list": [1, {"x": -0.0}], 7: "int key"}},
            "text é",
        ]
    )
    other = rng.choice([(1, 2), OrderedDict(a=1), Bid("u", 1.5), {"t": (1, 2)}])
    value = other if rng.random() < 0.3 else plain
    return (rng.choice(["k", 3, (1, "a")]), value) if keyed else value


def _written(sink: KafkaSink, rec: Record, keyed: bool) -> Any:
    """What the Kafka sink writes of a record: key, value, headers (or why it cannot)."""
    try:
        return sink.record(rec, 10**6, keyed)
    except Exception as exc:  # noqa: BLE001 - refused alike, or the test fails
        return f"{type(exc).__name__}: {exc}"


def test_sink_records_are_what_a_retry_decodes_from_the_backup() -> None:
    record_types.register((Bid,))
    sink = KafkaSink("out", bootstrap_servers="localhost:1")
    held = 0
    for seed in range(200):
        rng = random.Random(seed)
        keyed = rng.random() < 0.5
        target = TargetSpec(0, TargetKind.SINK, "out", keyed)
        dead = TargetSpec(1, TargetKind.DEAD, "dead-letters", False)
        spec = StageSpec("p", "s", (), (), (target, dead))
        out = Boundaries(spec, True, Cursor(), lambda parent: "here")
        elems = [_element(rng, keyed) for _ in range(rng.randrange(1, 20))]
        out.add(0, elems, [rng.randbytes(16) for _ in elems], list(range(len(elems))))
        outputs = out.take()
        if rng.random() < 0.3:  # a function changed what it returned after it left
            changed = elems[rng.randrange(len(elems))]
            changed = changed[1] if keyed else changed
            if isinstance(changed, dict):
                changed["changed"] = True
        replayed = [Output(*o) for o in outputs[: rng.randrange(len(outputs) + 1)]]
        first = out.made.records(replayed + outputs[len(replayed) :], target)
        held += len(outputs) - len(replayed)
        retry = decode_outputs(outputs, target)
        assert [_typed(r.elem) for r in first] == [_typed(r.elem) for r in retry], seed
        assert [(r.id, r.ts) for r in first] == [(r.id, r.ts) for r in retry]
        assert all(type(r) is Record for r in first)
        for a, b in zip(first, retry, strict=True):
            assert _written(sink, a, keyed) == _written(sink, b, keyed), seed
        assert len(out.made.elements) == len(replayed)  # the rest delivered: no longer held
    assert held > 1000


def test_a_redone_chunk_forgets_its_elements() -> None:
    """A chunk whose commit is refused is redone: the elements of its outputs are dropped."""
    target = TargetSpec(0, TargetKind.SINK, "out", False)
    spec = StageSpec("p", "s", (), (), (target, TargetSpec(1, TargetKind.DEAD, "d", False)))
    out = Boundaries(spec, True, Cursor(), lambda parent: "here")
    out.add(0, [{"a": 1}], [b"p" * 16], [0])
    out.take()
    out.made.chunk_committed()
    out.add(0, [{"a": 2}], [b"q" * 16], [1])
    out.take()
    assert len(out.made.elements) == 2
    out.clear()  # the second chunk is redone
    assert [o.value for o, _ in out.made.elements.values()] == [b"\x81\xa1a\x01"]


def test_outputs_left_to_the_delivery_job_keep_no_elements() -> None:
    """Deferred (group commit), a task's sink outputs are delivered by another job from the
    backup: the stage must not hold their elements for the rest of the task."""
    target = TargetSpec(0, TargetKind.SINK, "out", False)
    spec = StageSpec("p", "s", (), (), (target, TargetSpec(1, TargetKind.DEAD, "d", False)))
    body = StageBody(spec, Guarantee.EXACTLY_ONCE, 1, 0)
    counts: dict[str, int] = {}

    def count(name: str, n: int = 1) -> None:
        counts[name] = counts.get(name, 0) + n

    task = TaskRef("s", 1, 0, sinks=((0, "out"),))
    sinks = SinkDelivery(spec, NoGuard(), body, task, count, lambda point: None, defer=True)
    for n in range(3):  # three chunks
        body.out.add(0, [{"n": n}, [n]], [b"p" * 16, b"q" * 16], [n, n])
        outputs = body.take()
        body.chunk_committed()
        assert sinks.hold({0: outputs}) == []
    assert sinks.deferred
    assert len(body.out.made.elements) == 0
