"""Runners: a job from start to end on one process (local.py), on torchrun's tensor-parallel
ranks (torchrun.py), on worker processes of this node (workers/) or over a Ray cluster (ray/).
Every one takes its rows from a row source (row_sources.py), turns them into requests and output
rows through the one row pipeline (row_pipeline.py), and hands every finished row to the one
output sink (batchrun.io.output.sink), whose finish ends the job."""
