#!/usr/bin/env bash
# Builds .venv-verl (rlk-mm[vl,verl] from this checkout: verl 0.9.1 with its own dependencies,
# transformers in the range verl accepts, >=5.5.3,<5.11; real ray) and runs verl's actor worker test there:
# tests/integrations/frameworks/test_verl_worker.py (verl's ActorRolloutRefWorker on the CPU, around the tiny
# Qwen2.5-VL, verl's defaults against rlk_mm switched on). Idempotent: the environment is built
# once and rebuilt only when the requirements below change (a stamp file holds them).
#
#   bash tests/integrations/frameworks/verl_env.sh            (extra arguments go to pytest)
set -euo pipefail
cd "$(dirname "$0")/../../.."
start=$SECONDS
PY=${PY:-python3}
VENV=.venv-verl
TORCH=torch==2.13.0
# cachetools, fastapi, uvicorn: from verl's verl-core extra, imported by its PPO trainer module
REQUIREMENTS="verl==0.9.1 transformers>=5.5.3,<5.11,!=5.6.0 ray[default]>=2.41 cachetools fastapi uvicorn pytest>=8 hypothesis>=6.100"
STAMP=$VENV/.rlk_mm_requirements
WANT="$TORCH $REQUIREMENTS rlk-mm[vl,verl] $(sha1sum pyproject.toml)"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    test -x $VENV/bin/python || $PY -m venv $VENV
    # torch first (on a CPU machine the CPU wheel), then held there, so nothing pulls a CUDA build
    $VENV/bin/python -c "import torch" 2>/dev/null || $VENV/bin/python -m pip install -q --no-compile $TORCH
    constraints=$VENV/constraints.txt
    $VENV/bin/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$constraints"
    # uv resolves verl's ~130 dependencies in seconds, where pip's resolver backtracks for many minutes
    $VENV/bin/python -m pip install -q uv
    # shellcheck disable=SC2086  # word splitting intended: one requirement per word
    $VENV/bin/python -m uv pip install -q --python $VENV/bin/python -c "$constraints" $REQUIREMENTS -e ".[vl,verl]"
    echo "$WANT" > "$STAMP"
fi
echo "verl_env: $VENV ready (verl $($VENV/bin/python -c 'import importlib.metadata as m; print(m.version("verl"))'), transformers $($VENV/bin/python -c 'import importlib.metadata as m; print(m.version("transformers"))')) after $((SECONDS - start)) s"

# -p no:cacheprovider: the checkout may be read-only; -rs: say why anything skipped
status=0
$VENV/bin/python -m pytest -q -rs -p no:cacheprovider tests/integrations/frameworks/test_verl_worker.py "$@" || status=$?
echo "verl_env: done in $((SECONDS - start)) s (exit $status)"
exit $status
