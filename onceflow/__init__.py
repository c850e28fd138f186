"""Onceflow: streaming pipelines with exactly-once results on Apache Spark.

Everything a pipeline author needs is importable from here::

    from onceflow import Pipeline, KafkaSource, KafkaSink, DedupConfig

The repository's folders install as subpackages of this one (``onceflow.pipeline``,
``onceflow.graph_optimizer``, ``onceflow.runtime``, ``onceflow.dedup``, ``onceflow.backup``,
``onceflow.connectors``, ``onceflow.kernel``, ``onceflow.operations``, ``onceflow.testing``,
``onceflow.cli``); import from them only for what is not re-exported here.

The names below are imported when first used (PEP 562), not with the package: Spark starts
a fresh Python interpreter for each step of planning a Python data source (looking the
sources up, creating one, its stream reader), and each one that unpickles the Kafka source
imports ``onceflow.connectors.kafka.datasource``, and with it this package. Importing the
whole API there cost ~0.3-0.8 s per interpreter (measured with ``python -X importtime``),
several times in a run's start-up. ``onceflow.windows`` and the other short module names
are aliases of ``onceflow.pipeline.<name>``, made the first time they are imported
(:class:`_Aliases`), so the alias is the very module, not a copy.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from onceflow.connectors.kafka import KafkaSink, KafkaSource
    from onceflow.dedup.config import DedupConfig
    from onceflow.kernel.changes import Change
    from onceflow.kernel.errors import ConfigError, OnceflowError
    from onceflow.kernel.eventtime import EventTime
    from onceflow.pipeline import codecs, combiners, sinks, sources, state, windows
    from onceflow.pipeline.api import Pipeline, Stream
    from onceflow.pipeline.errors import PipelineError
    from onceflow.pipeline.joins import CoGroup
    from onceflow.pipeline.windows import Fixed, Global, Pane, Sessions, Sliding, Trigger
    from onceflow.runtime.combine_fn import CombineFn
    from onceflow.runtime.driver.result import RunResult
    from onceflow.runtime.driver.run_config import RunConfig
    from onceflow.runtime.errors import RunError

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "KafkaSink": "onceflow.connectors.kafka",
    "KafkaSource": "onceflow.connectors.kafka",
    "DedupConfig": "onceflow.dedup.config",
    "Change": "onceflow.kernel.changes",
    "ConfigError": "onceflow.kernel.errors",
    "OnceflowError": "onceflow.kernel.errors",
    "EventTime": "onceflow.kernel.eventtime",
    "Pipeline": "onceflow.pipeline.api",
    "Stream": "onceflow.pipeline.api",
    "PipelineError": "onceflow.pipeline.errors",
    "CoGroup": "onceflow.pipeline.joins",
    "Fixed": "onceflow.pipeline.windows",
    "Global": "onceflow.pipeline.windows",
    "Pane": "onceflow.pipeline.windows",
    "Sessions": "onceflow.pipeline.windows",
    "Sliding": "onceflow.pipeline.windows",
    "Trigger": "onceflow.pipeline.windows",
    "CombineFn": "onceflow.runtime.combine_fn",
    "RunError": "onceflow.runtime.errors",
    "RunResult": "onceflow.runtime.driver.result",
    "RunConfig": "onceflow.runtime.driver.run_config",
}
# ``onceflow.<alias>`` is ``onceflow.pipeline.<alias>``
_ALIASES = ("codecs", "combiners", "sinks", "sources", "state", "windows")


if not TYPE_CHECKING:  # mypy sees the names above, and flags a misspelt one

    def __getattr__(name: str) -> Any:
        """An exported name, imported on first use (then kept in the package's namespace)."""
        if name in _EXPORTS:
            value = getattr(importlib.import_module(_EXPORTS[name]), name)
        elif name in _ALIASES:
            value = importlib.import_module(f"{__name__}.{name}")
        else:
            msg = f"module {__name__!r} has no attribute {name!r}"
            raise AttributeError(msg)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    """The package's names, the ones not imported yet among them."""
    return sorted(set(globals()) | set(__all__))


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import onceflow.windows`` gives the module ``onceflow.pipeline.windows`` itself."""

    def __init__(self) -> None:
        self.specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec for ``onceflow.<alias>``; None for every other module."""
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _ALIASES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The real module (imported now if need be)."""
        module = importlib.import_module(f"{__name__}.pipeline.{spec.name.rpartition('.')[2]}")
        self.specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run; the import system gave the module the alias's spec: undo that."""
        module.__spec__ = self.specs.pop(module.__name__, module.__spec__)


if not any(isinstance(finder, _Aliases) for finder in sys.meta_path):
    sys.meta_path.append(_Aliases())

__all__ = [
    "Change",
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
