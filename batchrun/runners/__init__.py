"""Runners: a job from start to end on one process (local.py), on torchrun's tensor-parallel
ranks (torchrun.py, rank_worker.py) or over a Ray cluster (ray/). Each feeds the engine its own
way and hands every finished row to the one output sink (batchrun.io.output.sink)."""
