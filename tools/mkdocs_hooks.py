"""MkDocs hook: lay the ``onceflow`` package out as installed, for the API reference.

The repository's folders install as subpackages of ``onceflow`` (``pipeline/`` as
``onceflow.pipeline`` ...), which static analysis cannot see from the folders themselves.
As ``tools/typecheck.py`` does for mypy, this builds the installed layout as symbolic links
(under ``build/docs-api/``, which ``mkdocs.yml`` gives mkdocstrings as its search path)
before MkDocs reads any page. It also points ``pymdownx.snippets`` at the repository root,
so that pages can include real, tested code (``--8<-- "tests/docs/test_tutorial.py:orders"``)
wherever MkDocs is started from.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

_TOOLS = Path(__file__).resolve().parent
ROOT = _TOOLS.parent
TREE = ROOT / "build" / "docs-api"


def on_startup(**_: Any) -> None:
    """Build the tree once, when MkDocs starts (a build or ``mkdocs serve``)."""
    spec = importlib.util.spec_from_file_location("onceflow_typecheck", _TOOLS / "typecheck.py")
    assert spec is not None and spec.loader is not None
    typecheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(typecheck)
    typecheck.build_tree(TREE)


def on_config(config: Any) -> Any:
    """Snippets are read from the repository root."""
    snippets = config["mdx_configs"].setdefault("pymdownx.snippets", {})
    snippets["base_path"] = [str(ROOT)]
    return config
