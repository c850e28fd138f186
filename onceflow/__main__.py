"""``python -m onceflow`` is the ``onceflow`` command."""

from __future__ import annotations

from onceflow.cli.main import main

raise SystemExit(main())
