"""The driver's side of a run: start-up, micro-batches, the job as DataFrames, observing."""
