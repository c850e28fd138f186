"""What a user touches: the Pipeline, its transforms, sources, sinks and combiners.

>>> from onceflow.pipeline import Pipeline, sources, sinks
>>> p = Pipeline("wordcount")
>>> words = p.read("lines", sources.TextFile("book.txt")).flat_map("split", str.split)
>>> counts = words.key_by("by-word", str.lower).combine_per_key("count", "count")
>>> counts.write("out", sinks.JsonLines("counts.jsonl"))
"""

from __future__ import annotations

from onceflow.pipeline import combiners, sinks, sources
from onceflow.pipeline.api import Pipeline, Stream
from onceflow.pipeline.combiners import CombineFn

__all__ = ["CombineFn", "Pipeline", "Stream", "combiners", "sinks", "sources"]
