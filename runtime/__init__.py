"""The runtime: executes a :class:`~onceflow.runtime.spec.Job` on Spark.

:mod:`~.spec` the job and stage descriptions the optimizer lowers plans into; :mod:`~.body`
and :mod:`~.task` the executor (one task of one stage, each in parts its docstring names);
:mod:`~.guard` what a task asks of the exactly-once machinery; :mod:`~.spark` a job as
DataFrames; :mod:`~.bounded` and :mod:`~.streaming` the two drivers (the streaming one in
parts: :mod:`~.startup`, :mod:`~.run_context`, :mod:`~.batch_run`, :mod:`~.query`,
:mod:`~.observe`), and :mod:`~.run_config` the one typed configuration they take;
:mod:`~.session`, :mod:`~.progress`, :mod:`~.metrics`; :mod:`~.faults` the crashpoints.
"""
