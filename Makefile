# make setup: idempotent runtime install; creates .venv, installs the CPU torch first (a plain `pip install
# torch` would fetch a multi-GB CUDA build), then the project WITHOUT test tools (the test extra pulls
# NVIDIA triton, which shadows pytorch-triton-xpu on an Intel host). make test adds the test extra.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
TORCH ?= torch==2.13.0

.PHONY: setup setup-test serve test lint clean

setup: $(STAMP)

setup-test: $(TEST_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[test]"
	touch $(TEST_STAMP)

serve: setup
	$(BIN)/xpulora serve

test: setup-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

lint: setup-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# make docker-test: builds the CPU image from the Dockerfile on this machine (starting a Docker daemon and
# making a base image if needed) and drives docs/smoke.sh against running containers; see tools/docker_test.sh.
# Not part of `make test`: it needs root and Docker and takes minutes.
.PHONY: docker-test
docker-test:
	tools/docker_test.sh
