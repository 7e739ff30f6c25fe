#!/usr/bin/env bash
# Issue 32 on a 4-GPU machine: the vocab-parallel GPU tests at 2, 3 and 4 ranks (every rank
# must pass), then bench_tp at tp 1/2/4, with the topology recorded. Writes to $OUT:
# topo.txt, vp_gpu_tests_<ranks>.log (one per rank count), tp/<card>/<day>-default.json. NVLink multicast off.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-.}
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
for ranks in ${RANKS:-2 3 4}; do
  timeout ${RANK_TIMEOUT:-240} torchrun --nproc-per-node "$ranks" -m pytest -q -m gpu -p no:cacheprovider \
    tests/ops/test_vocab_parallel_gpu.py > "$OUT/vp_gpu_tests_${ranks}.log" 2>&1
  echo "ranks $ranks: exit $? ($(grep -cE '[0-9]+ passed' "$OUT/vp_gpu_tests_${ranks}.log") ranks reported passed)"
done
timeout ${BENCH_TIMEOUT:-300} torchrun --nproc-per-node 4 -m bench.bench_tp --tp 1 2 4 --out "$OUT" ${BENCH_TP_ARGS:-} \
  > "$OUT/bench_tp.log" 2>&1
echo "bench_tp: exit $?"
