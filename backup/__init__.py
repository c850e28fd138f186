"""Upstream backup: outputs are stored with their IDs before they are sent on.

A stage's task writes each chunk of outputs into its backup hash (one per stage, micro-batch
and partition) in the same atomic step that marks the chunk's inputs as seen (the commit of
:mod:`onceflow.dedup.commit`). A retry of the task, or of the whole micro-batch, replays these
outputs instead of running user code again, so non-deterministic code still yields one
answer. Backups of a micro-batch are acknowledged once Spark has committed it, and then are
garbage. :mod:`~onceflow.backup.format` is the format, :mod:`~onceflow.backup.store` the
writing, replay and acknowledgement.
"""
