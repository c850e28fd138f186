"""Compiling a physical plan to PySpark: driver-side wiring and worker-side stage code."""
