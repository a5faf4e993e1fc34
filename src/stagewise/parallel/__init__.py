"""Stage partitioning, proxy tensors and tensor parallelism inside a stage."""
