#!/usr/bin/env bash
# Do the smoke tasks learn? One call on a 4-GPU machine: every run of bench/configs/smoke_tasks_gpu.json
# side by side (bench/smoke_sweep.py): the point and video-direction tasks and their shuffled controls,
# 3 seeds each, on CUDA (about 8 small runs per GPU), and the colour task's seeds 0-3 on the CPU (2 threads
# each). Runs not done at the deadline are killed and reported with the steps they made.
#
#   OUT=/some/dir bash bench/gpu_smoke_tasks.sh     # about 8 minutes
#
# Also four bench/point_diagnosis.py runs (one per GPU): the point task and its control at the settings
# under which their reward fell, and at the new ones: $OUT/point_diagnosis/NAME/point_diagnosis.jsonl
# and the run's result, $OUT/point_diagnosis/NAME/point_diagnosis/<card>/<day>-<task>.json.
# Writes $OUT/smoke_tasks/: sweep.json (each run's per-step reward curve and summary), margins.json
# (per variant: the seeds' last-10-step rewards, the margins over the control and chance, learns or
# not), NAME.log, NAME.steps.jsonl and NAME/smoke_report.json per run, and the sweep's result
# smoke_sweep/<card>/<day>-smoke-tasks-gpu.json (copy it into bench/results/).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_smoke_tasks}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT/smoke_tasks" "$OUT/point_diagnosis"
nvidia-smi -L > "$OUT/smoke_tasks/gpus.txt" 2>&1 || true
# the point task's decline, answer by answer: the settings that fell (lr 3e-3, 16 x 4) and the new ones
diagnose() {  # NAME GPU TASK smoke-options...
    local name=$1 gpu=$2 task=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=1 timeout "${DEADLINE:-450}" "$PYTHON" -m bench.point_diagnosis \
        --out "$OUT/point_diagnosis/$name" --task "$task" --threads 1 --device cuda --warmup-steps 100 \
        --temperature 0.7 "$@" > "$OUT/point_diagnosis/$name.log" 2>&1 || true
}
diagnose old-task 0 point --steps 100 --lr 3e-3 --lr-warmup-steps 40 &
diagnose old-control 1 point-shuffled --steps 100 --lr 3e-3 --lr-warmup-steps 40 &
diagnose new-task 2 point --steps 250 --lr 1e-3 --lr-warmup-steps 20 --prompts 32 --samples 8 &
diagnose new-control 3 point-shuffled --steps 250 --lr 1e-3 --lr-warmup-steps 20 --prompts 32 --samples 8 &
"$PYTHON" -m bench.smoke_sweep bench/configs/smoke_tasks_gpu.json --out "$OUT/smoke_tasks" \
    --gpus "${GPUS:-4}" --per-gpu "${PER_GPU:-8}" --cpu-workers 8 --threads 2 --deadline "${DEADLINE:-450}" \
    > "$OUT/smoke_tasks/sweep.log" 2>&1
wait
rm -f "$OUT"/smoke_tasks/*/smoke_layout.png  # one picture per run is enough: the curves
cat "$OUT/smoke_tasks/margins.json"
