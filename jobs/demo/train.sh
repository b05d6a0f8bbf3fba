#!/bin/bash
# Train the demo pair shipped in batchrun/demo/ (seeded; run on one GPU, about 10 minutes):
#   jobs/demo/train.sh target WORK   # tokenizer + target, then the target's own completions
#   jobs/demo/train.sh draft WORK    # the DFlash drafter trained on those completions
# then copy WORK/target and WORK/draft into batchrun/demo/ (what the package ships).
set -euo pipefail
stage=${1:?stage: target or draft}
work=${2:?work directory}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$work"
case "$stage" in
target)
    python3 -m batchrun.train.target --out "$work/target" --device cuda --seed 0 --steps 500
    # Drafter data: prefixes of TRAIN-split files, completed greedily by the target through
    # batchrun itself, exactly as a user would make data for their own target.
    python3 -m batchrun.train.prompts --tokenizer "$work/target" --split train --count 8000 \
        --out "$work/draft-prompts.parquet"
    python3 -m batchrun.cli run --input "$work/draft-prompts.parquet" --target "$work/target" \
        --draft none --max-tokens 256 --output "$work/completions" --device cuda --quiet \
        --max-batch-size 512 --max-batched-tokens 16384 --overwrite
    ;;
draft)
    python3 -m batchrun.train.draft --target "$work/target" --data "$work/completions" \
        --out "$work/draft" --block-size 16 --layers 2 --intermediate 512 --layer-ids 1,3 \
        --device cuda --seed 0 --time-limit 240
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
