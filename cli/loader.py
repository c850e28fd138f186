"""Loading a pipeline from a Python file, for ``onceflow run`` and ``onceflow explain``.

A pipeline file exposes its pipeline in one of three ways, tried in this order:

1. ``--pipeline NAME`` names a module-level ``Pipeline`` or a function returning one;
2. a module-level function ``build()`` returning a ``Pipeline``;
3. exactly one module-level ``Pipeline`` object (any variable name).

The file runs with ``__name__ == "__onceflow__"``, so its ``if __name__ == "__main__":``
block (handy for ``python file.py``) does not run. Deprecation warnings its own calls raise
(an argument renamed) are shown, as Python shows them for a ``__main__`` script.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
import warnings
from typing import Any

from onceflow.cli.errors import PipelineFileError
from onceflow.kernel.errors import OnceflowError
from onceflow.pipeline.api import Pipeline

RUN_NAME = "__onceflow__"


def load_pipeline(path: str, attr: str | None = None) -> Pipeline:
    """The pipeline exposed by the file at ``path``."""
    if not os.path.isfile(path):
        msg = f"pipeline file {path!r} does not exist (working directory: {os.getcwd()})"
        raise PipelineFileError(msg)
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # let the file import its neighbours
    warnings.filterwarnings("default", category=DeprecationWarning, module=RUN_NAME)
    namespace = _run_file(path)
    if attr is not None:
        if attr not in namespace:
            msg = f"{path} has no attribute {attr!r}; pass the name of a Pipeline or a builder"
            raise PipelineFileError(msg)
        return _as_pipeline(path, attr, namespace[attr])
    if callable(namespace.get("build")) and not isinstance(namespace["build"], Pipeline):
        return _as_pipeline(path, "build", namespace["build"])
    found = {k: v for k, v in namespace.items() if isinstance(v, Pipeline)}
    if len(found) == 1:
        return next(iter(found.values()))
    if not found:
        msg = (
            f"{path} defines no pipeline: add a module-level Pipeline, or a build() function "
            "returning one"
        )
    else:
        names = ", ".join(sorted(found))
        msg = f"{path} defines several pipelines ({names}); pick one with --pipeline"
    raise PipelineFileError(msg)


def _run_file(path: str) -> dict[str, Any]:
    """The file's module namespace; an error of its own code as one line naming where.

    The pipeline file is the user's code: a missing environment variable or an import it
    cannot make is said in one line with the file's line, not a traceback through runpy.
    """
    try:
        return runpy.run_path(path, run_name=RUN_NAME)
    except (SystemExit, KeyboardInterrupt):
        raise
    except OnceflowError:  # already one line a user can act on
        raise
    except Exception as exc:  # noqa: BLE001 - any error of the user's module becomes one line
        here = os.path.abspath(path)
        frames = [
            f
            for f in traceback.extract_tb(exc.__traceback__)
            if os.path.abspath(f.filename) == here
        ]
        where = f"{path}:{frames[-1].lineno}" if frames else path
        what = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, KeyError):
            what += " (a name the file reads is not set: an environment variable?)"
        msg = f"loading {where} failed: {what}"
        raise PipelineFileError(msg) from exc


def _as_pipeline(path: str, name: str, value: Any) -> Pipeline:
    if isinstance(value, Pipeline):
        return value
    if callable(value):
        result = value()
        if isinstance(result, Pipeline):
            return result
        msg = f"{path}: {name}() returned {type(result).__name__}, not a Pipeline"
        raise PipelineFileError(msg)
    msg = f"{path}: {name!r} is a {type(value).__name__}, not a Pipeline or a function"
    raise PipelineFileError(msg)
