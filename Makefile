# make setup: idempotent; creates .venv, installs the CPU torch first (a plain `pip install torch`
# would fetch a multi-GB CUDA build), then the project with its test extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0

.PHONY: setup serve test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

serve: setup
	$(BIN)/xpulora serve

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
