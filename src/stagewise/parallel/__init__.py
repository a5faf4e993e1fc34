"""Stage partitioning, proxy tensors and stage-to-stage transport."""
