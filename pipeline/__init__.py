"""What a user touches: the Pipeline, its transforms, sources, sinks and combiners.

>>> from pipeline import Pipeline, sources, sinks
>>> p = Pipeline("wordcount")
>>> words = p.read("lines", sources.TextFile("book.txt")).flat_map("split", str.split)
>>> counts = words.key_by("by-word", str.lower).combine_per_key("count", "count")
>>> counts.write("out", sinks.JsonLines("counts.jsonl"))
"""

from __future__ import annotations

from pipeline import combiners, sinks, sources
from pipeline.api import Pipeline, Stream
from pipeline.combiners import CombineFn

__all__ = ["CombineFn", "Pipeline", "Stream", "combiners", "sinks", "sources"]
