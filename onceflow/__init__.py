"""Onceflow: streaming pipelines with exactly-once results on Apache Spark.

Everything a pipeline author needs is importable from here::

    from onceflow import Pipeline, KafkaSource, KafkaSink, DedupConfig

The repository's folders install as subpackages of this one (``onceflow.pipeline``,
``onceflow.graph_optimizer``, ``onceflow.runtime``, ``onceflow.dedup``, ``onceflow.backup``,
``onceflow.connectors``, ``onceflow.kernel``, ``onceflow.operations``, ``onceflow.testing``,
``onceflow.cli``); import from them only for what is not re-exported here.
"""

from __future__ import annotations

from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.dedup.config import DedupConfig
from onceflow.kernel.errors import ConfigError, OnceflowError
from onceflow.pipeline import combiners, sinks, sources
from onceflow.pipeline.api import Pipeline, Stream
from onceflow.pipeline.errors import PipelineError
from onceflow.runtime.combine_fn import CombineFn
from onceflow.runtime.errors import RunError
from onceflow.runtime.result import RunResult

__version__ = "0.1.0"

__all__ = [
    "CombineFn",
    "ConfigError",
    "DedupConfig",
    "KafkaSink",
    "KafkaSource",
    "OnceflowError",
    "Pipeline",
    "PipelineError",
    "RunError",
    "RunResult",
    "Stream",
    "__version__",
    "combiners",
    "sinks",
    "sources",
]
