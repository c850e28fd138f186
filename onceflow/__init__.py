"""Onceflow: streaming pipelines with exactly-once results on Apache Spark.

Everything a pipeline author needs is importable from here::

    from onceflow import Pipeline, KafkaSource, KafkaSink, DedupConfig

The repository's folders install as subpackages of this one (``onceflow.pipeline``,
``onceflow.graph_optimizer``, ``onceflow.runtime``, ``onceflow.dedup``, ``onceflow.backup``,
``onceflow.connectors``, ``onceflow.kernel``, ``onceflow.operations``, ``onceflow.testing``,
``onceflow.cli``); import from them only for what is not re-exported here.
"""

from __future__ import annotations

import sys

from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.dedup.config import DedupConfig
from onceflow.kernel.errors import ConfigError, OnceflowError
from onceflow.kernel.eventtime import EventTime
from onceflow.pipeline import codecs, combiners, sinks, sources, state, windows
from onceflow.pipeline.api import Pipeline, Stream
from onceflow.pipeline.errors import PipelineError
from onceflow.pipeline.joins import CoGroup
from onceflow.pipeline.windows import Fixed, Global, Pane, Sessions, Sliding, Trigger
from onceflow.runtime.combine_fn import CombineFn
from onceflow.runtime.errors import RunError
from onceflow.runtime.result import RunResult
from onceflow.runtime.run_config import RunConfig

__version__ = "0.1.0"

# ``from onceflow.windows import Sliding`` works as well as ``onceflow.windows.Sliding``.
for _module in (codecs, combiners, sinks, sources, state, windows):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module

__all__ = [
    "CoGroup",
    "CombineFn",
    "ConfigError",
    "DedupConfig",
    "EventTime",
    "Fixed",
    "Global",
    "KafkaSink",
    "KafkaSource",
    "OnceflowError",
    "Pane",
    "Pipeline",
    "PipelineError",
    "RunConfig",
    "RunError",
    "RunResult",
    "Sessions",
    "Sliding",
    "Stream",
    "Trigger",
    "__version__",
    "codecs",
    "combiners",
    "sinks",
    "sources",
    "state",
    "windows",
]
