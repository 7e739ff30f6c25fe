#!/usr/bin/env bash
# The colour task's margin on many CPU cores: every run of bench/configs/smoke_colour_margin.json side by
# side (bench/smoke_sweep.py), THREADS (default 2) each, on the CPU of a GPU machine (32 cores on a 2-GPU host).
# Runs not done at the deadline are killed and reported with the steps they made.
#
#   OUT=/some/dir bash bench/cpu_colour_sweep.sh     # about 9 minutes
#
# Writes $OUT/colour/: sweep.json, margins.json, NAME.log, NAME.steps.jsonl, NAME/smoke_report.json, and
# the sweep's result smoke_sweep/cpu/<day>-<configs name>.json (copy it into bench/results/).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cpu_colour_sweep}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT/colour"
nproc > "$OUT/colour/cpus.txt"
"$PYTHON" -m bench.smoke_sweep "${CONFIGS:-bench/configs/smoke_colour_margin.json}" --out "$OUT/colour" \
    --cpu-workers "${WORKERS:-28}" --threads "${THREADS:-2}" --deadline "${DEADLINE:-540}" > "$OUT/colour/sweep.log" 2>&1
rm -f "$OUT"/colour/*/smoke_layout.png
cat "$OUT/colour/margins.json"
