# Fresh machine: `make serve` (setup + server) or `make test` (setup + whole test suite).
# Setup is idempotent: a second run takes seconds (see scripts/setup.sh).

VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-unit test-engine test-server lint clean-model

setup:
	@bash scripts/setup.sh

## OpenAI-compatible server on the default model (extra vLLM arguments: make serve ARGS='--port 8001')
serve: setup
	$(VENV)/bin/obcache-vllm serve $(ARGS)

## Whole suite: unit + engine + slow tests
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

test-engine: setup
	$(PY) -m pytest -m engine $(PYTEST_ARGS)

test-server: setup
	$(PY) -m pytest -m server $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

## Rebuild the cached model from the packaged GGUF
clean-model: setup
	$(VENV)/bin/obcache-vllm model pull --force
