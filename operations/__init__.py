"""Operating pipelines: garbage collection (``gc``), ``status`` and ``audit``."""
