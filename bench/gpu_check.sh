#!/usr/bin/env bash
# One device call: the GPU tests, then `batchrun bench --shape`, logs and JSON under $OUT.
# Run through the device tool from the repository root, carrying .whl (jsonschema and its
# dependencies, which the GPU image lacks):
#   bash bench/gpu_check.sh                 # tests, then the default sweep
#   TESTS=0 BENCH_ARGS="--batch-sizes 1,32" bash bench/gpu_check.sh
# FLASHINFER=1 also installs flashinfer from .fiwhl (carry it too: the slimmed flashinfer-python
# and apache-tvm-ffi wheels, see ../shared/tools/README.md) and keeps its JIT cache between
# calls: .fiwhl/jit-cache.tar.gz is unpacked first, $OUT/jit-cache.tar.gz written after the tests.
#   FLASHINFER=1 BENCH=0 TEST_FILES=tests/kernels/test_flashinfer_backend.py bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-bench/results/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
FI_CACHE=/tmp/fi-cache
if [ "${FLASHINFER:-0}" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .fiwhl/*.whl \
        || exit 1
    find /tmp/site -exec touch -h -d 2020-01-01 {} +  # else ninja rebuilds the cached modules
    export FLASHINFER_WORKSPACE_BASE=$FI_CACHE FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
    mkdir -p "$FI_CACHE"
    for cache in .fiwhl/jit-cache.tar*; do  # GNU tar keeps the file times and sees the gzip
        [ -f "$cache" ] && tar -xf "$cache" -C "$FI_CACHE" && echo "JIT cache from $cache"
    done
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rP -p no:cacheprovider -m gpu \
        ${TEST_FILES:-tests/kernels/test_triton_kernels.py tests/kernels/test_triton_engine.py} 2>&1 \
        | grep -v '^$' | tail -n 80 | tee "$OUT/gpu-tests.log"
fi
if [ "${FLASHINFER:-0}" = 1 ]; then  # keep it under 16 MiB to come back from $OUT
    tar -czf "$OUT/jit-cache.tar.gz" -C "$FI_CACHE" . && ls -l "$OUT/jit-cache.tar.gz"
fi
if [ "${BENCH:-1}" = 1 ]; then
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-400}" python3 -m batchrun.cli bench --shape "${SHAPE:-qwen3-8b}" \
        ${BENCH_ARGS:-} --out "$OUT/bench-${SHAPE:-qwen3-8b}.json" 2>&1 | tee "$OUT/bench.log"
fi
if [ -n "${JOBS:-}" ]; then
    # The job benchmark (batchrun bench --jobs): whole jobs at the Qwen3-8B shape, e.g.
    #   TESTS=0 BENCH=0 JOBS=w1,w2,b1 bash bench/gpu_check.sh
    # JOBS_ARGS adds flags (--tau, --widths, --hf-jobs, --jobs-max-batched-tokens).
    # shellcheck disable=SC2086
    timeout "${JOBS_TIMEOUT:-470}" python3 -m batchrun.cli bench --jobs "$JOBS" \
        --scratch /tmp/batchrun-jobs ${JOBS_ARGS:-} --out "$OUT/jobs-${JOBS//,/-}.json" 2>&1 \
        | grep -v -i warning | tee "$OUT/jobs-${JOBS//,/-}.log"
fi
if [ "${DEMO:-0}" = 1 ]; then
    # The demo job for real: no draft, the full block and the adaptive width, at two batch sizes
    # (DEMO_BATCHES, default "4 48"), each run REPEATS times (default 3; the median counts: one
    # short job's rate is noisy). The modes take turns within each repeat, so that a drift in
    # the machine (clocks, a neighbour on the host) falls on all three alike. A short untimed
    # run of each first: Triton compiles a kernel variant on its first use, and that would
    # count in the measured run's generation time.
    modes=("--draft none" "--verify-width full" "--verify-width auto")
    for batch in ${DEMO_BATCHES:-4 48}; do
        for rep in 0 $(seq "${REPEATS:-3}"); do
            for mode in "${modes[@]}"; do
                name="b$batch-$(echo "$mode" | tr -dc 'a-z')"
                extra=(--output "/tmp/demo/$name-$rep")
                [ "$rep" = 0 ] && extra=(--output "/tmp/warm/$name" --max-tokens 32)
                # shellcheck disable=SC2086
                python3 -m batchrun.cli run jobs/demo.toml --max-batch-size "$batch" $mode \
                    --quiet --overwrite "${extra[@]}" > /dev/null 2>&1 || echo "$name failed"
            done
        done
        for mode in "${modes[@]}"; do
            name="b$batch-$(echo "$mode" | tr -dc 'a-z')"
            python3 -c "import json,statistics,sys; d=[json.load(open(f'/tmp/demo/{sys.argv[1]}-{r}/stats.json')) for r in range(1, int(sys.argv[2]) + 1)]; \
                print(sys.argv[1], 'median', round(statistics.median(x['output_tokens_per_second'] for x in d)), 'runs', [round(x['output_tokens_per_second']) for x in d], 'tau', d[0].get('acceptance_length'), 'widths', [x.get('verify_width_steps') for x in d])" \
                "$name" "${REPEATS:-3}"
        done
    done | tee "$OUT/demo-widths.txt"
fi
if [ -f "$OUT/bench-${SHAPE:-qwen3-8b}.json" ]; then
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('\n\n'.join(k + '\n' + v for k, v in d.get('profiles', {}).items()))" "$OUT/bench-${SHAPE:-qwen3-8b}.json" > "$OUT/profile.txt"
fi
