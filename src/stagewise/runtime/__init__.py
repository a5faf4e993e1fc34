"""One stage on one device: worker, input building, KV tensors, sampler, memory planner."""
