"""``python -m onceflow`` is the ``onceflow`` command."""

from __future__ import annotations

from pipeline.cli import main

raise SystemExit(main())
