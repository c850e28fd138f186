"""Names of a package imported on first use (PEP 562), for light package ``__init__`` files.

Spark starts fresh Python interpreters to plan a Python data source, and each one imports
the package of the data source it unpickles: a package ``__init__`` that imports its whole
API there cost ~0.3-0.8 s per interpreter. :func:`exports` gives such a package the
``__getattr__`` and ``__dir__`` that import a name from its defining module when first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def exports(
    namespace: dict[str, Any], names: Mapping[str, str | tuple[str, str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package whose globals are ``namespace``.

    ``names``: exported name -> the module defining it, or ``(module, its name there)``. A
    name imported once is kept in the package's namespace, so the next use does not come here.
    """
    package = namespace["__name__"]

    def getattr_(name: str) -> Any:
        if name not in names:
            msg = f"module {package!r} has no attribute {name!r}"
            raise AttributeError(msg)
        where = names[name]
        module, defined = where if isinstance(where, tuple) else (where, name)
        value = getattr(importlib.import_module(module), defined)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return getattr_, dir_
