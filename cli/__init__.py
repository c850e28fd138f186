"""The ``onceflow`` command: run, explain and demo pipelines, and operate them."""
