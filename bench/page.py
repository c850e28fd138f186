"""Sections of ``docs/benchmarks.md`` that each benchmark writes from its own output.

``bench/exactly_once.py`` writes the page's head (the exactly-once table); other benchmarks
write a section of their own (``## Sinks`` ...), which a regeneration of the head keeps, as it
keeps the hand-written ``## The other benchmarks`` at the end.
"""

from __future__ import annotations

OTHER_BENCHMARKS = "## The other benchmarks"
GENERATED_SECTIONS = (
    "## Peers",
    "## Sinks",
    "## Nexmark",
    "## Nexmark latency",
    "## Latency and recovery",
    "## Soak",  # written by tests/exactly_once/soak.py --markdown
    "## Change data capture",  # bench/cdc.py
    "## Rescale",  # bench/rescale.py
)


def section(text: str, heading: str) -> str:
    """The section under ``heading``, up to the next ``## `` heading ('' if absent)."""
    at = text.find(heading + "\n")
    if at < 0:
        return ""
    end = text.find("\n## ", at + len(heading))
    return text[at:] if end < 0 else text[at : end + 1]


def read(path: str) -> str:
    """The page's text ('' if it does not exist yet)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


def kept(path: str) -> str:
    """What a regeneration of the head keeps: the generated sections, then the hand-written."""
    text = read(path)
    parts = [section(text, h) for h in GENERATED_SECTIONS]
    at = text.find(OTHER_BENCHMARKS)
    parts.append(text[at:] if at >= 0 else "")
    return "\n".join(p.rstrip("\n") + "\n" for p in parts if p)


def replace_section(path: str, heading: str, body: list[str]) -> None:
    """Write ``heading`` + ``body`` into the page, in place of the old one or before the end."""
    text = read(path)
    new = "\n".join([heading, "", *body]).rstrip("\n") + "\n\n"
    old = section(text, heading)
    if old:
        text = text.replace(old, new, 1)
    elif OTHER_BENCHMARKS in text:
        text = text.replace(OTHER_BENCHMARKS, new + OTHER_BENCHMARKS, 1)
    else:
        text = text.rstrip("\n") + "\n\n" + new
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
