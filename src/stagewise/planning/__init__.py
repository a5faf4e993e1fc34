"""Planning for the driver, before and between pipelines, from a model's facts and the nodes'
reports: the memory plan (`memory.py`: one stage's budget, KV cap and floor, and what a node may
use), the per-stage cost model (`stage_cost.py`), the partition planner over nodes (`planner.py`),
the cluster plan (`cluster.py`) and the `stagewise plan` report (`report.py`). Nothing here runs a
step; `runtime/` is the device side."""
