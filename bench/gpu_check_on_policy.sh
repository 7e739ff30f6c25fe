#!/usr/bin/env bash
# Issue 30 on one GPU: the on-policy GPU tests (rollout and decode bitwise equal to the training
# forward on CUDA/Triton; the invariant-mode kernels), then bench_on_policy. Writes to $OUT:
# on_policy_gpu_tests.log, bench_on_policy.log, on_policy/<card>/<day>-default.json. The long smoke runs (colour 400
# steps, point 200 steps after 100 warm-up) are tests/smoke/test_smoke.py's gpu tests: run them with
# SMOKE=1 (several minutes each).
set -u
OUT=${OUT:-.}
timeout ${TEST_TIMEOUT:-240} python -m pytest -q -m gpu -p no:cacheprovider \
  tests/models/test_on_policy.py tests/ops/test_batch_invariant.py > "$OUT/on_policy_gpu_tests.log" 2>&1
echo "gpu tests: exit $? ($(tail -1 "$OUT/on_policy_gpu_tests.log"))"
timeout ${BENCH_TIMEOUT:-540} python -m bench.bench_on_policy --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench_on_policy.log" 2>&1
echo "bench_on_policy: exit $?"
if [ "${SMOKE:-0}" = 1 ]; then
  timeout ${SMOKE_TIMEOUT:-1500} python -m pytest -q -m gpu -p no:cacheprovider tests/smoke/test_smoke.py -k "gpu" -s \
    > "$OUT/smoke_gpu.log" 2>&1
  echo "smoke gpu: exit $?"
fi
