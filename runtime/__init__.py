"""The runtime: executes a :class:`~onceflow.runtime.spec.Job` on Spark, in four rooms.

* :mod:`~onceflow.runtime.driver`: what runs on the driver. The two drivers (bounded and
  streaming: start-up, the micro-batch loop, the query, observing), the job compiled to
  DataFrames (``compile``), pinning, the run configuration.
* :mod:`~onceflow.runtime.task`: what runs in a Spark task. The executor's loop over one
  task of one stage: its input, chunk commits, sink deliveries and transactions.
* :mod:`~onceflow.runtime.ops`: the operators a fused stage runs inside the task. Flat-maps,
  combines, windows, ``process`` with state and timers, restamps.
* :mod:`~onceflow.runtime.spark_env`: Spark itself. The SparkSession, the driver JVM's
  launch and class-data archive, the warm Python worker daemon.

Beside them, what every room shares: :mod:`~onceflow.runtime.spec` (the job and stage
descriptions the optimizer lowers plans into), :mod:`~onceflow.runtime.guard` (what a task
asks of the exactly-once machinery), :mod:`~onceflow.runtime.combine_fn` and
:mod:`~onceflow.runtime.user_state` (contracts users implement), the task counters
(:mod:`~onceflow.runtime.metrics`), the crashpoints (:mod:`~onceflow.runtime.faults`) and
errors. The driver may import the task room, the task room the ops room; never the other
way (``tests/architecture/layers.py``, ``ROOMS``).
"""
