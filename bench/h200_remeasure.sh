#!/usr/bin/env bash
# The H200 re-measurement (issue 36) as device calls: each STAGE (a space list) is one group of
# `batchrun bench --jobs` runs whose ratios are taken within that call; every result JSON and one
# log go to $OUT, written as each stage ends (a call cut short still returns the finished ones).
# A stage gets the time left before DEADLINE seconds (default 570), so the call ends in its limit.
# Carry WHEELS (jsonschema and friends, click, xgrammar: the image lacks them) and, for the
# redesign's before, BEFORE (`git archive` of the old commit's batchrun/, its hash in COMMIT).
#   STAGES="nodraft before fp8 default-batch moe" bash bench/h200_remeasure.sh
#   STAGES="gpu-tests drafts-a drafts-b drafts-j1" GPU_TESTS_BUDGET=150 bash bench/h200_remeasure.sh
set -uo pipefail
OUT=$(realpath -m "${OUT:-bench/results/out}")
WHEELS=${WHEELS:-.whl}
BEFORE=${BEFORE:-.before}
DEADLINE=${DEADLINE:-570}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl \
    || exit 1
# A `git archive` of the commit (no .git travels) names it in COMMIT: results record it.
[ -f COMMIT ] && export BATCHRUN_SOURCE_COMMIT=$(cat COMMIT)
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
LOG="$OUT/remeasure.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$LOG"

left() { echo $((DEADLINE - SECONDS)); }

jobs() {  # NAME ARGS...: one `bench --jobs` run writing $OUT/NAME.json
    local name=$1 budget
    shift
    budget=$(left)
    [ "$budget" -gt 30 ] || { echo "== $name: skipped, ${budget}s left" | tee -a "$LOG"; return; }
    echo "== $name ($budget s left): bench --jobs $*" | tee -a "$LOG"
    # RUN_DIR: where `python3 -m` runs (its batchrun/ comes first on the path)
    (cd "${RUN_DIR:-.}" && timeout "$budget" python3 -m batchrun.cli bench --jobs "$@" \
        --out "$OUT/$name.json") 2>&1 | grep -v -i warning | tee -a "$LOG"
}

for stage in ${STAGES:-nodraft}; do
    case $stage in
    nodraft)  # no draft on W1 and W2, and transformers' generate() three times on each
        jobs jobs-w1-w2-nodraft-generate w1,w2 --widths '' --tau '' --hf-jobs w1,w2 \
            --scratch /tmp/bj ;;
    nodraft-w1)  # W1 alone: no draft, and generate() three times on it
        jobs jobs-w1-nodraft-generate w1 --widths '' --tau '' --hf-jobs w1 --scratch /tmp/bj ;;
    stall-free)  # W1 with the prompt chunks beside decode rows capped (the engine's
        # prefill_beside_decode) at 256, 512 and 768, against uncapped W1 in the same call
        jobs jobs-w1-nodraft-uncapped w1 --widths '' --tau '' --scratch /tmp/bj
        for cap in 256 512 768; do
            jobs "jobs-w1-prefill-beside-$cap" w1 --widths '' --tau '' \
                --jobs-prefill-beside-decode "$cap" --scratch /tmp/bj
        done ;;
    before)  # the redesign's before on W1 (BEFORE's code, same scratch checkpoint)
        RUN_DIR=$BEFORE jobs jobs-w1-nodraft-before w1 --widths '' --tau '' --scratch /tmp/bj
        # the old code wrote no provenance: name the commit it ran
        python3 -c "import json,sys; p=sys.argv[1]; d=json.load(open(p)); d.setdefault('provenance', {'commit': open(sys.argv[2]).read().strip(), 'note': 'added by bench/h200_remeasure.sh: this commit predates provenance'}); json.dump(d, open(p, 'w'), indent=1)" \
            "$OUT/jobs-w1-nodraft-before.json" "$BEFORE/COMMIT" ;;
    seams)  # issue 43's before and after on W1, no draft and the oracle at tau 6.5 under auto,
        # after / before / after, so the machine's drift shows (BEFORE's code, same scratch)
        for side in after before after2; do
            dir=. commit=${BATCHRUN_SOURCE_COMMIT:-}
            [ "$side" = before ] && dir=$BEFORE commit=$(cat "$BEFORE/COMMIT")
            BATCHRUN_SOURCE_COMMIT=$commit RUN_DIR=$dir jobs "jobs-w1-seams-$side" w1 \
                --widths auto --tau 6.5 --scratch /tmp/bj
        done ;;
    fp8)  # FP8 weights and FP8 KV on W1, against the bf16 W1 of stage nodraft (same call)
        jobs jobs-w1-fp8-weights-fp8-kv w1 --widths '' --tau '' --fp8-weights \
            --kv-cache-dtype fp8 --scratch /tmp/bj8 ;;
    fp8-profiled)  # bf16 and FP8 weights + KV on W1, no draft, each profiled too (an untimed
        # repeat: its kernels by time), so the two jobs' kernels say where FP8 gains and not
        jobs jobs-w1-bf16-profiled w1 --widths '' --tau '' --profile-jobs w1 --scratch /tmp/bj
        jobs jobs-w1-fp8-weights-fp8-kv-profiled w1 --widths '' --tau '' --fp8-weights \
            --kv-cache-dtype fp8 --profile-jobs w1 --scratch /tmp/bj8 ;;
    default-batch)  # W1 as a user who sets no --max-batch-size runs it, and at 64, 128, 256
        jobs jobs-w1-default-batch w1 --widths '' --tau '' --jobs-default-batch \
            --scratch /tmp/bj
        jobs jobs-w1-batch-sweep w1@64,w1,w1@256 --widths '' --tau '' --scratch /tmp/bj ;;
    moe)  # the MoE shape's W1 (24 layers), bf16 then FP8 weights and KV (disk: one at a time)
        rm -rf /tmp/bj /tmp/bj8
        jobs jobs-moe-w1-bf16 w1 --shape qwen3-30b-a3b --num-layers 24 --widths '' --tau '' \
            --scratch /tmp/bm
        rm -rf /tmp/bm
        jobs jobs-moe-w1-fp8-weights-fp8-kv w1 --shape qwen3-30b-a3b --num-layers 24 \
            --widths '' --tau '' --fp8-weights --kv-cache-dtype fp8 --scratch /tmp/bm8 ;;
    drafts-a)  # every drafter mode on the shorter workloads, constant and changing acceptance
        jobs jobs-w1-w2-b1-drafts w1,w2,b1 --tau 3,6.5 --scenarios 'collapse,mixed rows' \
            --widths auto,full --scratch /tmp/bj ;;
    drafts-policy)  # the width policy's contract on a short call: tau 6.5 and the scenarios
        # (PROFILED: as in drafts-short)
        jobs jobs-w1-w2-b1-j1-policy w1,w2,b1,j1 --tau 6.5 --scenarios 'collapse,mixed rows' \
            --widths auto,full --profile-jobs "${PROFILED-}" --scratch /tmp/bj ;;
    drafts-short)  # the policy on the two short workloads (a last call's budget); PROFILED
        # (workloads, default none): each of their runs again under the profiler, with its
        # steps traced (period against GPU time by kind and width, graph replays)
        jobs jobs-w2-b1-drafts w2,b1 --tau 6.5 --scenarios 'collapse,mixed rows' \
            --widths auto,full --profile-jobs "${PROFILED-}" --scratch /tmp/bj ;;
    drafts-useless)  # W1 and J1 with a drafter that accepts nothing, under auto and full
        jobs jobs-w1-j1-useless w1,j1 --tau '' --widths auto,full --scratch /tmp/bj ;;
    drafts-j1)
        jobs jobs-j1-drafts j1 --tau 3,6.5 --widths auto,full --scratch /tmp/bj ;;
    drafts-b)
        jobs jobs-w3-w4-drafts w3,w4 --tau 3,6.5 --widths auto,full --scratch /tmp/bj ;;
    hybrid-steps)  # the hybrid qwen3.5-9b: decode steps at batch 1, 32, 128 against the
        # roofline (state counted), DFlash projected at tau 3 and 6.5 from the measured rounds,
        # each verify width's rollback (the linear states' replay) timed apart
        budget=$(left)
        echo "== steps-qwen3.5-9b ($budget s left)" | tee -a "$LOG"
        timeout "$budget" python3 -m batchrun.cli bench --shape qwen3.5-9b --batch-sizes 1,32,128 \
            --contexts 1024 --steps 16 --tau 3,6.5 --no-hf-eager --hf-compiled-batches '' \
            --out "$OUT/steps-qwen3.5-9b.json" 2>&1 | grep -v -i warning | tee -a "$LOG" ;;
    hybrid-jobs)  # W2 (batch 32) on the hybrid: no draft, the oracle at tau 3 and 6.5
        # (HYBRID_TAU: others; PROFILED=w2: each run again under the profiler, traced)
        jobs jobs-qwen3.5-9b-w2-drafts w2 --shape qwen3.5-9b --tau "${HYBRID_TAU:-3,6.5}" \
            --widths auto,full \
            --profile-jobs "${PROFILED-}" --scratch /tmp/bh ;;
    dflash2)  # DFlash2 against DFlash at the Qwen3-8B shape, the oracle at tau 6.5: what the
        # selector and the convolutions add to a round (method_costs)
        # and each run's kernels (an untimed repeat): where the extra time goes
        jobs "jobs-$(echo "${DFLASH2_JOBS:-b1,w2}" | tr , -)-dflash2" "${DFLASH2_JOBS:-b1,w2}" \
            --tau 6.5 --widths full \
            --draft-methods dflash,dflash2 \
            --profile-jobs "${DFLASH2_PROFILED-b1,w2}" --scratch /tmp/bj ;;
    dflash2-kernels)  # the selector's top-K (Triton) against torch.topk and argmax, in graphs
        PYTHONPATH=.:$PYTHONPATH timeout "$(left)" python3 bench/topk.py --out "$OUT/topk.json" \
            2>&1 | tee -a "$LOG" ;;
    gpu-tests)  # at most GPU_TESTS_BUDGET seconds (default: what is left)
        budget=$(left)
        budget=$((budget < ${GPU_TESTS_BUDGET:-$budget} ? budget : ${GPU_TESTS_BUDGET:-$budget}))
        # the files with GPU tests (the rest import packages the image lacks: polars, moto)
        timeout "$budget" python3 -m pytest -q -p no:cacheprovider -m gpu \
            ${GPU_TEST_FILES:-$(grep -rl "mark.gpu" tests | sort)} 2>&1 \
            | grep -v '^$' | tail -n 60 | tee "$OUT/gpu-tests${GPU_TESTS_TAG:-}.log" ;;
    *) echo "unknown stage $stage" | tee -a "$LOG" ;;
    esac
done
echo "== done at ${SECONDS}s" | tee -a "$LOG"
