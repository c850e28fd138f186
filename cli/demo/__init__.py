"""Demos of the quick start: a bounded word count and the exactly-once run."""
