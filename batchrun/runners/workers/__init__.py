"""`batchrun run --workers N`: the parent (run.py), its worker processes (worker.py) and the
chunks of rows they claim (chunks.py)."""
