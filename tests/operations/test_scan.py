"""SCAN may return a key twice (Redis resized its table mid-scan): each key is seen once."""

from __future__ import annotations

from onceflow.operations.gc import scan_steps


class _Pages:
    """SCAN's answers as a resizing Redis gives them: the second page repeats a key."""

    def __init__(self) -> None:
        self.pages = {0: (7, [b"ofl:{p}:stats:a", b"ofl:{p}:meta"]), 7: (0, [b"ofl:{p}:stats:a"])}

    def scan(self, cursor: int, match: str, count: int) -> tuple[int, list[bytes]]:
        return self.pages[cursor]


def test_a_key_scan_returns_twice_is_yielded_once():
    steps = list(scan_steps(_Pages(), "ofl:{p}:*", 10))
    assert steps == [["ofl:{p}:stats:a", "ofl:{p}:meta"]]
