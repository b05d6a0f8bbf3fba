"""Ray Data as batchrun's distributed engine (the extra `batchrun[ray]`).

`BatchrunProcessor` is the engine as a callable class for users' own `ds.map_batches`
pipelines; `batchrun.runners.ray.run.run_job_ray` is `batchrun run JOB --ray`, whose driver
commits through the output sink (committer.py). Importing this package does not import Ray.
"""

from batchrun.runners.ray.processor import BatchrunProcessor

__all__ = ["BatchrunProcessor"]
