# The two commands: `make smoke` and `make test`. Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlk_mm_installed

.PHONY: setup smoke test clean

setup: $(STAMP)

# torch==2.13.0 first: on a CPU machine that is the local CPU wheel, and the package's
# torch range is then already satisfied, so pip never pulls the CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps verl==0.9.1
	touch $(STAMP)

smoke: $(STAMP)
	$(BIN)/rlk-mm smoke

test: $(STAMP)
	$(BIN)/python -m pytest -q
