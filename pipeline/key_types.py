"""Both sides of a keyed join must be keyed alike: ``"u1"`` never equals ``b"u1"``.

A join pairs values whose keys are equal, so a stream keyed by text joined with a table keyed
by the raw bytes of a Kafka key pairs nothing, and a left join then gives every value a None
partner, silently. Two checks refuse it:

* **when the pipeline is built**, if both key functions say what they return (a return
  annotation, ``def user_of(click) -> str``) and the kinds differ;
* **on the first records**, otherwise: the join's stage, after its shuffle, sees keys of both
  sides, and when the kinds of keys one side has shown share none with the other side's, the
  run stops with one line (:class:`KeysDiffer`, never a dead letter per record).

A key's kind is its type's name, except that ``bool``, ``int`` and ``float`` are one kind
(``1 == 1.0``).
"""

from __future__ import annotations

import typing
from typing import Any

from onceflow.pipeline.errors import PipelineError
from onceflow.runtime.errors import StopStage

NUMBER = "number"
KAFKA_HINT = (
    "a Kafka key is bytes unless the source decodes it: KafkaSource(..., key_codec='utf-8')"
)


class KeysDiffer(StopStage):
    """The two sides of a join show keys of different types: no key can ever match."""


def kind_of(key: Any) -> str:
    """The kind of a key (its type's name; any number is ``number``)."""
    if isinstance(key, bool | int | float):
        return NUMBER
    return type(key).__name__


def declared_kind(fn: Any) -> str | None:
    """The kind a key function says it returns (its return annotation), or None."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - a hint that does not resolve says nothing
        return None
    kind = hints.get("return")
    if not isinstance(kind, type) or kind is type(None):
        return None
    return NUMBER if issubclass(kind, bool | int | float) else kind.__name__


def check_declared(join: str, sides: tuple[str, str], kinds: tuple[str | None, str | None]) -> None:
    """Refuse, when the pipeline is built, a join whose key functions declare unlike kinds."""
    left, right = kinds
    if left is not None and right is not None and left != right:
        msg = (
            f"{join}: {sides[0]} is keyed by {left} and {sides[1]} by {right}, so no key can "
            f"match; key both sides alike ({KAFKA_HINT})"
        )
        raise PipelineError(msg)


class KeySides:
    """The kinds of key each side of one join has shown (in one task; see the module doc)."""

    __slots__ = ("join", "seen", "sides")

    def __init__(self, join: str, sides: tuple[str, str]) -> None:
        self.join = join
        self.sides = sides
        self.seen: tuple[dict[str, Any], dict[str, Any]] = ({}, {})

    def see(self, side: int, key: Any) -> None:
        """Note a key of ``side`` (0 or 1); raise :class:`KeysDiffer` when the kinds differ."""
        kinds = self.seen[side]
        kind = kind_of(key)
        if kind in kinds:
            return
        kinds[kind] = key
        other = self.seen[1 - side]
        if other and not kinds.keys() & other.keys():
            raise KeysDiffer(self._message())

    def _message(self) -> str:
        (kind0, key0), (kind1, key1) = (next(iter(seen.items())) for seen in self.seen)
        return (
            f"{self.join}: {self.sides[0]} is keyed by {kind0} ({key0!r}) but {self.sides[1]} "
            f"by {kind1} ({key1!r}), so no key can ever match; key both sides alike "
            f"({KAFKA_HINT})"
        )
