"""Ray Data as batchrun's distributed engine (the extra `batchrun[ray]`).

`BatchrunProcessor` is the engine as a callable class for users' own `ds.map_batches`
pipelines; `batchrun.ray.run.run_job_ray` is `batchrun run JOB --ray`. Importing this package
does not import Ray.
"""

from batchrun.ray.processor import BatchrunProcessor

__all__ = ["BatchrunProcessor"]
