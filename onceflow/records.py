"""The shapes records take inside Onceflow's runtime."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, NamedTuple


class Record(NamedTuple):
    """A record inside a stage: a 16-byte ID (b"" when IDs are off), event time in ms, element."""

    id: bytes
    ts: int
    elem: Any


class Output(NamedTuple):
    """A record leaving a stage, already encoded: what is backed up and then sent on.

    ``target`` indexes the stage's outputs (ports to other stages, then sinks); ``key`` holds
    the encoded key for keyed streams; ``value`` the encoded value (or element).
    """

    target: int
    id: bytes
    ts: int
    key: bytes | None
    value: bytes


@dataclass(frozen=True)
class DeadLetter:
    """A record that could not be processed, with the reason and where it came from."""

    id: bytes
    ts: int
    stage: str
    error: str
    origin: str
    raw: bytes | None = None  # the undecodable payload, when there is one
    value: str | None = None  # a printable form of a decoded value that failed later

    def to_element(self) -> dict[str, Any]:
        """The dead letter as a plain, JSON-friendly element (what dead-letter sinks write)."""
        out: dict[str, Any] = {
            "stage": self.stage,
            "error": self.error,
            "origin": self.origin,
            "id": self.id.hex(),
            "ts": self.ts,
        }
        if self.raw is not None:
            out["raw_b64"] = base64.b64encode(self.raw).decode()
        if self.value is not None:
            out["value"] = self.value
        return out
