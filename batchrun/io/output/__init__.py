"""The job's output: the output directory, its parts, statistics, progress and claims."""
