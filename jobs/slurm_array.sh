#!/bin/bash
# One Parquet dataset, split over a Slurm array: task I of N takes the rows with
# row_index % N == I and writes its own part files into the shared output directory.
# A task that is preempted or killed resumes where it stopped when it is requeued;
# the last task to finish writes OUT/_SUCCESS.
#
#   sbatch --array=0-7 jobs/slurm_array.sh jobs/example.toml
#
#SBATCH --job-name=batchrun
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --output=logs/%x-%A_%a.out

set -euo pipefail
JOB_FILE=${1:?usage: sbatch --array=0-N jobs/slurm_array.sh JOB.toml}
exec batchrun run "$JOB_FILE" --quiet \
    --shard "${SLURM_ARRAY_TASK_ID}/${SLURM_ARRAY_TASK_COUNT}"
