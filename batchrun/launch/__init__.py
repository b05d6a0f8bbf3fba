"""Launching a job on tensor-parallel processes: `batchrun run --tp N` re-executed under torchrun
(torchrun.py) and the rank worker it starts (worker.py). Above the pipeline: it runs jobs."""
