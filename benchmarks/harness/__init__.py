"""A simulated cluster on one machine (network namespaces, delayed and rate-limited links, cgroup
limits) for tests and benchmarks: `benchmarks.harness.cluster`."""
