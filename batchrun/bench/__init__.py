"""`batchrun bench`: end to end on a checkpoint (end_to_end.py), or a sweep of steady-state steps
at a real model's shape with random weights (sweep.py), against baselines of the same run."""
