"""The operators a fused stage runs on the executor: flat-maps, combines, windows, process."""
