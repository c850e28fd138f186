"""The bounded word count the quick start shows first."""

from __future__ import annotations

import os
import re

from onceflow.pipeline.api import Pipeline
from onceflow.pipeline.sinks import Collect
from onceflow.pipeline.sources import TextFile

SAMPLE = os.path.join(os.path.dirname(__file__), "sample.txt")
_WORD = re.compile(r"[a-z']+")


def words(line: str) -> list[str]:
    """Lower-cased words of a line."""
    return _WORD.findall(line.lower())


def build(path: str = SAMPLE, sink: Collect | None = None) -> Pipeline:
    """Lines -> words -> keyed by word -> count per word -> sink."""
    p = Pipeline("wordcount")
    lines = p.read("lines", TextFile(path))
    counts = (
        lines.flat_map("split-words", words)
        .filter("drop-short", lambda w: len(w) > 2)
        .key_by("by-word", lambda w: w)
        .combine_per_key("count", "count")
    )
    counts.write("result", sink if sink is not None else Collect())
    return p
