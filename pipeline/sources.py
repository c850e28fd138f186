"""Sources a pipeline can read (re-exported from :mod:`connectors`)."""

from __future__ import annotations

from connectors.collections import Collection, Generate
from connectors.files import JsonLinesSource as JsonLines
from connectors.files import LineFiles, TextFile

__all__ = ["Collection", "Generate", "JsonLines", "LineFiles", "TextFile"]
