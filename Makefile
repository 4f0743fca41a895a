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

# make docker-test: builds the CPU image from the Dockerfile on this machine (starting a Docker daemon and
# making a base image if needed) and drives docs/smoke.sh against running containers; see tools/docker_test.sh.
# Not part of `make test`: it needs root and Docker and takes minutes.
.PHONY: docker-test
docker-test:
	tools/docker_test.sh
