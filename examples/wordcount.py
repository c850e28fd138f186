"""Word count over a text file: ``onceflow run examples/wordcount.py``.

Writes ``onceflow-output/wordcount.jsonl`` (one ``[word, count]`` per line).
"""

from onceflow import Pipeline, sinks, sources
from onceflow.cli.demo.wordcount import SAMPLE, words

pipeline = Pipeline("wordcount")
(
    pipeline.read("lines", sources.TextFile(SAMPLE))
    .flat_map("split-words", words)
    .key_by("by-word", lambda w: w)
    .combine_per_key("count", "count")
    .write("result", sinks.JsonLines("onceflow-output/wordcount.jsonl"))
)
