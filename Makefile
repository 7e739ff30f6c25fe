# The two commands: `make smoke` and `make test`. Both set up .venv on first use.
# `make lint` runs ruff (configured in pyproject.toml); `make test` runs it first.
# `make docs` builds the documentation site (mkdocs build --strict) into build/site.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlk_mm_installed
DOCS_STAMP := $(VENV)/.rlk_mm_docs_installed

.PHONY: setup smoke lint test docs clean

setup: $(STAMP)

# torch==2.13.0 first: on a CPU machine that is the local CPU wheel, and the package's
# torch range is then already satisfied, so pip never pulls the CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[vl,test]"
	$(BIN)/python -m pip install -q --no-deps verl==0.9.1
	touch $(STAMP)

smoke: $(STAMP)
	$(BIN)/rlk-mm smoke

lint: $(STAMP)
	$(BIN)/ruff check .

# the lint, then the main suite, then the suites that need other framework pins, each in its own
# environment built on first use: verl 0.9.1's actor worker (transformers < 5.11) and the
# builders under transformers 4.5x (EasyR1's)
test: $(STAMP) lint
	$(BIN)/python -m pytest -q
	bash tests/integrations/frameworks/verl_env.sh
	bash tests/integrations/frameworks/tf4_env.sh

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

# the site, with every warning an error: a broken link, a page missing from the nav or an API
# reference that does not resolve fails the build; bench/report.py renders the Benchmarks pages
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
