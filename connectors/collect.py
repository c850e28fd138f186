"""A sink that brings results back to the driver: for tests, notebooks and small demos."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onceflow.connectors.base import SinkConnector


class Collect(SinkConnector):
    """Keeps every element it receives in :attr:`results` (in the driver's memory).

    Elements travel back through Spark's result channel, so keep them small. Across a driver
    crash the list is gone: use it to look at results, not to prove exactly-once.
    """

    to_driver = True

    def __init__(self) -> None:
        self.results: list[Any] = []

    def describe(self) -> str:
        """One line for plans."""
        return "collect to driver"

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """A bounded run starts from an empty list."""
        if not streaming:
            self.results = []

    def receive(self, values: Sequence[Any]) -> None:
        """Append elements sent back by the workers."""
        self.results.extend(values)

    def __getstate__(self) -> dict[str, Any]:
        return {}  # workers never need the results

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.results = []
