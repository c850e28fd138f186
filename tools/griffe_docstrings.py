"""Griffe extension: the docstrings' reST habits, as Markdown, for the API reference.

The code's docstrings are written for people reading the source: Sphinx roles
(``:class:`~onceflow.windows.Pane```), doctest lines (``>>> ...``) and literal blocks
introduced by ``::``. mkdocstrings renders docstrings as Markdown, where a role would show as
typed and a doctest line as a quotation; this turns roles into code spans and doctest lines
into fenced ``pycon`` blocks, before the pages are rendered. Configured in ``mkdocs.yml``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
_PROMPT = (">>> ", "... ")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1]}`" if match.group(1) else f"`{target}`"


def markdown(text: str) -> str:
    """A docstring with roles as code spans, doctests fenced and ``::`` as ``:``."""
    text = _ROLE.sub(_role, text)
    out: list[str] = []
    in_doctest = False
    for line in text.splitlines():
        prompt = line.startswith(_PROMPT) or line in (">>>", "...")
        if prompt and not in_doctest:
            out += ["```pycon"]
            in_doctest = True
        elif not prompt and in_doctest:
            out += ["```"]
            in_doctest = False
        out.append(line[:-1] if line.endswith("::") and not prompt else line)
    if in_doctest:
        out.append("```")
    return "\n".join(out)


class Docstrings(griffe.Extension):
    """Rewrites every docstring once, as its object is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring."""
        del kwargs
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
