"""vLLM's eviction against the independent HF-transformers reference (issue 4).

Both sides run the default model in float32 on the same prompt token ids: the session's
in-process plugin engine (its worker records the kept indices per layer, see conftest.py) and
:mod:`obcache_vllm.evidence.hf_reference`, which applies the same scorer, pipeline and block
rule to HF's eager attention. Properties checked per (pipeline, scorer):

* kept indices per layer and KV head: |vLLM ∩ HF| / K >= 0.99 for every prompt and layer (the
  minimum, averaged over the layer's KV heads);
* greedy continuations (16 tokens, EOS ignored) identical on >= 90 % of >= 20 long prompts;
* vLLM evicted every prompt in every layer, with the block rule's kept count.

Prompts: the package's seeded needle haystacks (no data files), 600-800 tokens, context and
question tokenized separately and concatenated (so ``kv_compress_at`` = the context's length is
exact on both sides). All requests of all combos go in one ``generate`` call; the engine's
256-token step budget makes every prompt a chunked prefill, several requests share steps, and
the small pool queues some of them. The HF side runs meanwhile in a subprocess on the other core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support.texts import needle_parts

from obcache_vllm.eviction.planning import plan_eviction
from obcache_vllm.model import EXPECTED_CONFIG
from obcache_vllm.options import parse_kv_options

# The module fixture runs both sides (~5-10 min on 2 cores); it counts against the first test.
pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]

NUM_PROMPTS = 20
BLOCK_SIZE = 32  # the engine's (support.engine.ENGINE_KWARGS)
BUDGET = 256
NEW_TOKENS = 16
MIN_OVERLAP = 0.99
MIN_AGREEMENT = 0.90
NUM_LAYERS = EXPECTED_CONFIG["num_hidden_layers"]


@dataclass(frozen=True)
class Combo:
    """Options of one compared configuration, on the first ``prompts`` prompts."""

    options: dict
    prompts: int
    compress_at_context: bool = False  # query-agnostic: evict before the question

    def extra(self, context_len: int) -> dict:
        extra = {"kv_budget": BUDGET, **self.options}
        if self.compress_at_context:
            extra["kv_compress_at"] = context_len
        return extra


# Cost: one fp32 vLLM prefill per (combo, prompt), ~40 prefills of ~700 tokens; HF prefills each
# prompt once (all queries kept) plus each context once. The issue asks for >= 20 prompts; the
# main combo has 20, the others 4 each to keep the suite's time in check (with 4, the 90 %
# agreement bound still needs every continuation identical, as it did with 6). Also matched in
# session 1 with 20 prompts each: h2o+obcache_value (overlap 1.00000, 20/20) and tova+attn
# (1.0000, 20/20).
COMBOS = {
    "snapkv-obcache_key": Combo(
        {"kv_pipeline": "snapkv", "kv_scorer": "obcache_key", "kv_window": 32}, NUM_PROMPTS
    ),
    "h2o-obcache_value": Combo({"kv_pipeline": "h2o", "kv_scorer": "obcache_value"}, 4),
    "compress_at-snapkv-obcache_joint": Combo(
        {"kv_pipeline": "snapkv", "kv_scorer": "obcache_joint", "kv_window": 16}, 4, True
    ),
    # The server's default pipeline (configs/default.yaml): tova, one ranking per layer.
    "tova-shared-obcache_key": Combo(
        {"kv_pipeline": "tova", "kv_scorer": "obcache_key", "kv_per_head": False}, 4
    ),
}


def long_prompts(tokenizer) -> tuple[list[list[int]], list[int]]:
    """NUM_PROMPTS needle prompts of ~600-800 tokens and their context lengths."""
    prompts, contexts = [], []
    for i in range(NUM_PROMPTS):
        context, question, _ = needle_parts(19 + i % 7, seed=500 + i)
        ctx = tokenizer(context).input_ids
        prompts.append(ctx + tokenizer(question, add_special_tokens=False).input_ids)
        contexts.append(len(ctx))
    return prompts, contexts


# --- the two sides ------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One request's outcome: kept indices per layer index [Hkv, K] and the greedy tokens."""

    kept: dict[int, torch.Tensor]
    tokens: list[int]


def _layer_index(name: str) -> int:
    # vLLM layer names: "model.layers.{i}.self_attn.attn"
    return int(name.split("layers.")[1].split(".")[0])


def _run_vllm(engine, prompts, contexts) -> dict[str, list[Run]]:
    """All combos in one batch on the session's in-process fp32 engine."""
    from vllm import SamplingParams

    records = engine.runner.obcache_records
    assert records is not None, "OBCACHE_VLLM_RECORD_KEEP=1 must be set before the engine starts"
    before = set(records)
    requests, params = [], []
    for combo in COMBOS.values():
        for ids, ctx in zip(prompts[: combo.prompts], contexts, strict=False):
            requests.append({"prompt_token_ids": ids})
            params.append(
                SamplingParams(
                    temperature=0.0,
                    max_tokens=NEW_TOKENS,
                    ignore_eos=True,
                    extra_args=combo.extra(ctx),
                )
            )
    outputs = engine.llm.generate(requests, params, use_tqdm=False)
    # Internal request ids are "<RequestOutput.request_id>-<random suffix>".
    by_id = {rid.rsplit("-", 1)[0]: records[rid] for rid in records if rid not in before}
    runs = []
    for out in outputs:
        rec = by_id[out.request_id]
        kept = {_layer_index(n): idx for n, idx in rec.items() if isinstance(idx, torch.Tensor)}
        runs.append(Run(kept=kept, tokens=list(out.outputs[0].token_ids)))
    out, start = {}, 0
    for name, combo in COMBOS.items():
        out[name], start = runs[start : start + combo.prompts], start + combo.prompts
    return out


def hf_runs(
    model_path: str, prompts: list[list[int]], contexts: list[int]
) -> dict[str, list[Run]]:
    """Each prompt (and each compressed context) is prefilled once, all queries kept; then
    every combo evicts and decodes."""
    from obcache_vllm.evidence import hf_reference as ref

    model, _ = ref.load_model(model_path, dtype=torch.float32)
    runs: dict[str, list[Run]] = {name: [] for name in COMBOS}
    for i, (ids, ctx) in enumerate(zip(prompts, contexts, strict=True)):
        ids_t = torch.tensor(ids)
        states: dict[int, object] = {}
        for name, combo in COMBOS.items():
            if i >= combo.prompts:
                continue
            options = parse_kv_options(combo.extra(ctx), len(ids))  # as vLLM does
            point = options.compress_point(len(ids))
            if point not in states:
                states[point] = ref.prefill(model, ids_t[:point], query_window=-1)
            _, kept = ref.select_kept(states[point], options, BLOCK_SIZE)
            tokens, _ = ref.generate(model, states[point], kept, NEW_TOKENS, rest=ids_t[point:])
            runs[name].append(Run(kept=kept, tokens=tokens))
    return runs


def _start_hf(tmp: Path, model_path, prompts, contexts) -> subprocess.Popen:
    """``hf_runs`` in a fresh process, one torch thread, no vLLM import, on the core the engine
    does not use (it runs while the engine works).

    This process hosts the in-process engine: its CPU worker binds torch's OpenMP threads to
    the engine's cores and disables ``torch.set_num_threads``, so the reference would inherit
    vLLM's thread setup (and with 2 threads on 2 busy cores small ops spin-wait, ~10x slower).
    """
    spec = tmp / "in.json"
    spec.write_text(
        json.dumps({"model": str(model_path), "prompts": prompts, "contexts": contexts})
    )
    tests = str(Path(__file__).resolve().parents[1])  # support/ for the script's imports
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.Popen(
        [sys.executable, __file__, str(spec), str(tmp / "out.pt")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish_hf(proc: subprocess.Popen, tmp: Path) -> dict[str, list[Run]]:
    _, stderr = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"HF reference run failed:\n{stderr[-4000:]}")
    raw = torch.load(tmp / "out.pt")
    return {combo: [Run(kept=k, tokens=t) for k, t in runs] for combo, runs in raw.items()}


@dataclass(frozen=True)
class Comparison:
    prompts: list[list[int]]
    contexts: list[int]
    vllm: dict[str, list[Run]]
    hf: dict[str, list[Run]]
    seconds: dict[str, float]


@pytest.fixture(scope="module")
def comparison(engine, model_path, tokenizer) -> Comparison:
    prompts, contexts = long_prompts(tokenizer)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        proc = _start_hf(Path(tmp), model_path, prompts, contexts)
        try:
            vllm_runs = _run_vllm(engine, prompts, contexts)
            mid = time.perf_counter()
            hf = _finish_hf(proc, Path(tmp))
        finally:
            if proc.poll() is None:
                proc.kill()
    end = time.perf_counter()
    seconds = {"vllm": round(mid - start, 1), "hf_after_vllm": round(end - mid, 1)}
    lengths = [len(p) for p in prompts]
    print(f"\n{len(prompts)} prompts, {min(lengths)}-{max(lengths)} tokens; seconds {seconds}")
    return Comparison(prompts=prompts, contexts=contexts, vllm=vllm_runs, hf=hf, seconds=seconds)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a ∩ b| / K per head, averaged over heads (rows are sorted unique indices)."""
    per_head = [
        len(set(x.tolist()) & set(y.tolist())) / x.numel() for x, y in zip(a, b, strict=True)
    ]
    return sum(per_head) / len(per_head)


@pytest.mark.parametrize("combo", [pytest.param(c, id=c) for c in COMBOS])
def test_vllm_matches_hf_reference(comparison: Comparison, combo: str) -> None:
    vllm_runs, hf_runs = comparison.vllm[combo], comparison.hf[combo]
    overlaps, same, first_diff = [], 0, []
    for i, (v, h) in enumerate(zip(vllm_runs, hf_runs, strict=True)):
        ids = comparison.prompts[i]
        point = comparison.contexts[i] if COMBOS[combo].compress_at_context else len(ids)
        order = plan_eviction(
            logical_len=point, budget=BUDGET, dead_blocks=0, block_size=BLOCK_SIZE
        )
        assert order is not None
        # vLLM evicted, every layer, with the block rule's kept count; so did the reference.
        assert sorted(v.kept) == sorted(h.kept) == list(range(NUM_LAYERS))
        for layer, kept in v.kept.items():
            assert kept.shape == h.kept[layer].shape == (kept.shape[0], order.kept)
            overlaps.append(_overlap(kept, h.kept[layer]))
        assert len(v.tokens) == len(h.tokens) == NEW_TOKENS
        if v.tokens == h.tokens:
            same += 1
        else:
            first_diff.append(
                next(i for i, (a, b) in enumerate(zip(v.tokens, h.tokens, strict=True)) if a != b)
            )
    overlap = sum(overlaps) / len(overlaps)
    agreement = same / len(vllm_runs)
    print(
        f"\n{combo}: kept-index overlap mean {overlap:.5f} min {min(overlaps):.4f} "
        f"({len(overlaps)} layer x prompt); greedy {NEW_TOKENS}-token agreement {same}/"
        f"{len(vllm_runs)} = {agreement:.2f}; first differing step {first_diff}"
    )
    assert len(vllm_runs) == COMBOS[combo].prompts
    assert min(overlaps) >= MIN_OVERLAP, (combo, min(overlaps), overlap)
    assert agreement >= MIN_AGREEMENT, (combo, agreement, first_diff)


def _other_cores() -> set[int]:
    """The cores the in-process engine is not bound to (all of them if it uses every core)."""
    every = set(range(os.cpu_count() or 1))
    bound = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    engine = {int(c) for c in bound.replace(",", " ").split() if c.isdigit()}
    return (every - engine) or every


if __name__ == "__main__":  # the HF side, run by _start_hf: python THIS in.json out.pt
    os.sched_setaffinity(0, _other_cores())  # not the parent engine's core binding
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = hf_runs(spec["model"], spec["prompts"], spec["contexts"])
    raw = {combo: [(r.kept, r.tokens) for r in runs] for combo, runs in result.items()}
    torch.save(raw, sys.argv[2])
