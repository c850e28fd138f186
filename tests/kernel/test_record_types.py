"""Dataclasses, named tuples and pydantic models cross stage boundaries as what they are."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import namedtuple
from typing import NamedTuple

import msgpack
import pytest

from onceflow.kernel import codec, record_types
from onceflow.kernel.codec import value_codec
from onceflow.kernel.errors import CodecError


@dataclasses.dataclass(frozen=True)
class Item:
    sku: str
    qty: int


@dataclasses.dataclass(slots=True)
class Order:
    order_id: str
    items: list[Item]
    tags: dict[str, int] = dataclasses.field(default_factory=dict)
    total: float = dataclasses.field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.total = float(sum(i.qty for i in self.items))


class Point(NamedTuple):
    x: int
    y: int


Pair = namedtuple("Pair", "left right")


def test_records_come_back_as_their_classes_with_their_fields():
    order = Order("o1", [Item("a", 2), Item("b", 3)], {"vip": 1})
    order.total = 99.0  # a field set after __init__ keeps its value
    value = ("user-1", {"order": order, "at": Point(1, 2), "pair": Pair(Item("c", 1), None)})
    back = codec.decode(codec.encode(value))
    assert back == value
    assert type(back[1]["order"]) is Order and type(back[1]["order"].items[0]) is Item
    assert back[1]["order"].total == 99.0
    assert type(back[1]["at"]) is Point and back[1]["at"].x == 1
    assert type(back[1]["pair"]) is Pair and type(back[1]) is dict and type(back) is tuple


def test_pydantic_models_come_back_too():
    pydantic = pytest.importorskip("pydantic")

    class Payment(pydantic.BaseModel):
        amount: int
        currency: str = "EUR"

    back = codec.decode(codec.encode([Payment(amount=5)]))
    assert back == [Payment(amount=5)] and type(back[0]) is Payment


def test_a_class_the_worker_cannot_see_is_an_error_naming_it():
    data = msgpack.packb(
        msgpack.ExtType(codec._EXT_RECORD, codec._pack_nested(["__onceflow__:Ghost", {"a": 1}]))
    )
    with pytest.raises(CodecError, match="'Ghost'.*top level of the pipeline file"):
        codec.decode(data)


def test_decoding_never_imports_a_module_or_builds_anything_but_a_record():
    script = (
        "import msgpack, sys\n"
        "from onceflow.kernel import codec\n"
        "for name in ('antigravity:x', 'os:system', 'subprocess:Popen'):\n"
        "    data = msgpack.packb(msgpack.ExtType(codec._EXT_RECORD,\n"
        "        codec._pack_nested([name, {'args': 'true'}])))\n"
        "    try:\n"
        "        codec.decode(data)\n"
        "    except codec.CodecError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit('built ' + name)\n"
        "assert 'antigravity' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr + done.stdout


def test_the_classes_a_pipelines_functions_see_are_found():
    local = Pair  # a closure cell

    def uses_closure(x):
        return local(x, x)

    class Totals:  # a combine function: its methods' globals
        def add_input(self, acc, value):
            return Order("x", [])

    found = record_types.visible_types([lambda e: Item(e, 1), uses_closure, Totals(), None])
    assert {Item, Order, Point, Pair} <= set(found)
    assert all(not c.__module__.startswith("onceflow.") for c in found)


def test_the_json_codec_writes_a_dataclass_as_an_object():
    raw = value_codec("json").encode({"order": Item("a", 2), "at": Point(1, 2)})
    assert raw == b'{"order":{"sku":"a","qty":2},"at":[1,2]}'
