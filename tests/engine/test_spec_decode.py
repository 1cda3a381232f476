"""Budgets with speculative decoding (ngram drafts): served where every eviction happens before
decoding starts, refused for decode-time eviction, and why.

Greedy speculative decoding is lossless: the target model verifies each draft and keeps only
what it would have generated, so a greedy request gives the same tokens with drafts as without.
That is the oracle here, on the real engine and model (three fresh engines in subprocesses,
``pool_runner.py``):

* stock vLLM with drafts and the plugin with drafts give the same tokens without a budget;
* budgets that evict at the prompt's end or at ``kv_compress_at`` give with drafts the tokens
  they give without (the plugin without drafts: its budgets are checked against the HF
  reference in ``test_hf_reference.py``); ``kv_prefill_evict`` (whose chunks the drafts move)
  gives the HF reference's tokens for the chunk ends it evicted at; every block comes back and
  the KV oracle sees no mismatch;
* ``kv_decode`` is refused with drafts, naming the field (``admission.speculative_refusal``),
  and the same engine with that refusal lifted shows why: decode-time eviction around drafts
  leaves greedy's tokens (at least one of the ``kv_decode`` requests differs).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from support.engine import ENGINE_KWARGS, run_pool
from support.texts import needle_parts

from obcache_vllm import admission
from obcache_vllm.admission import parse_kv_options

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
               "prompt_lookup_min": 2}  # fmt: skip
NUM_PROMPTS = 4
PROMPT_END = {
    "snapkv": {"kv_budget": 256, "kv_pipeline": "snapkv", "kv_scorer": "obcache_key",
               "kv_window": 32},
    "tova-shared": {"kv_budget": 0.25, "kv_pipeline": "tova", "kv_per_head": False},
    "h2o": {"kv_budget": 256, "kv_pipeline": "h2o", "kv_scorer": "obcache_value"},
    "prefill-evict": {"kv_budget": 192, "kv_pipeline": "snapkv", "kv_prefill_evict": True},
}  # fmt: skip
DECODE = {"kv_budget": 128, "kv_pipeline": "tova", "kv_decode": True}


# The KV oracle checks every reuse; the worker records the kept positions.
VERIFY_AND_RECORD = {"OBCACHE_VLLM_VERIFY": "1", "OBCACHE_VLLM_RECORD_KEEP": "1"}


def _run(spec: dict, stock: bool, core: int) -> dict:
    return run_pool(spec, stock, core, VERIFY_AND_RECORD)


@pytest.fixture(scope="module")
def runs(tokenizer, model_path):
    plain, budgeted, decode = [], [], []
    for i in range(NUM_PROMPTS):
        context, question, _ = needle_parts(19 + i, seed=900 + i)
        ctx = tokenizer(context).input_ids
        ids = ctx + tokenizer(question, add_special_tokens=False).input_ids
        plain.append({"id": f"plain-{i}", "prompt_token_ids": ids, "max_tokens": 48})
        for arm, options in PROMPT_END.items():
            budgeted.append({"id": f"{arm}-{i}", "prompt_token_ids": ids, "max_tokens": 48,
                             "extra_args": options})  # fmt: skip
        budgeted.append({"id": f"compress-at-{i}", "prompt_token_ids": ids, "max_tokens": 48,
                         "extra_args": {"kv_budget": 128, "kv_compress_at": len(ctx)}})
        decode.append({"id": f"decode-{i}", "prompt_token_ids": ids, "max_tokens": 96,
                       "extra_args": DECODE})  # fmt: skip
    engine = {"model": str(model_path), **ENGINE_KWARGS}
    drafts = {**engine, "speculative_config": SPECULATIVE}
    cores = sorted(os.sched_getaffinity(0))
    with ThreadPoolExecutor(2) as pool:
        ours = pool.submit(_run, {"engine": drafts, "requests": plain + budgeted + decode,
                                  "lift": ["speculative"]}, False, cores[0])  # fmt: skip
        stock = pool.submit(_run, {"engine": drafts, "requests": plain}, True, cores[-1])
        ours, stock = ours.result(), stock.result()
        alone = _run({"engine": engine, "requests": budgeted + decode}, False, cores[-1])
    return plain, budgeted, decode, ours, stock, alone


def test_without_a_budget_the_plugin_gives_stock_tokens_with_drafts(runs):
    plain, _, _, ours, stock, _ = runs
    for r in plain:
        assert ours["results"][r["id"]]["token_ids"] == stock["results"][r["id"]]["token_ids"]


def test_prompt_end_budgets_give_with_drafts_the_tokens_they_give_without(runs, model_path):
    """Where the evictions fall does not depend on the drafts, except with kv_prefill_evict:
    it evicts at the end of each prefill chunk, and the drafts change how many tokens the
    other requests' decode steps take from each step's budget, so the chunks (and the kept
    sets) differ. Those are checked against the HF reference replaying the engine's own chunk
    ends, as test_hf_reference.py does."""
    import torch

    from obcache_vllm.evidence import hf_reference as ref

    _, budgeted, _, ours, _, alone = runs
    assert ours["steps"] > 0 and not ours["mismatches"]
    assert ours["free_at_end"] == ours["pool_blocks"]
    differ, replayed = [], []
    model = None
    for r in budgeted:
        got, want = ours["results"][r["id"]], alone["results"][r["id"]]
        assert got["obcache"]["evictions"] >= 1, (r["id"], got["obcache"])
        if not r["extra_args"].get("kv_prefill_evict"):
            differ += [r["id"]] if got["token_ids"] != want["token_ids"] else []
            continue
        if model is None:
            model, _ = ref.load_model(model_path)
        ids = torch.tensor(r["prompt_token_ids"])
        options = parse_kv_options(r["extra_args"], len(ids))
        ends = [length for length, prefill in got["orders"] if prefill]
        result = ref.run_evicting(model, ids, options, ENGINE_KWARGS["block_size"],
                                  r["max_tokens"], prefill_ends=ends)  # fmt: skip
        replayed.append((r["id"], got["token_ids"] == result.token_ids))
    assert not differ, f"left greedy's tokens with drafts: {differ}"
    assert replayed and all(same for _, same in replayed), replayed


def test_decode_time_eviction_is_refused_with_drafts_and_why(runs):
    _, _, decode, ours, _, alone = runs
    differ = [r["id"] for r in decode
              if ours["results"][r["id"]]["token_ids"] != alone["results"][r["id"]]["token_ids"]]
    print(f"\nkv_decode with drafts (refusal lifted): {len(differ)} of {len(decode)} requests "
          f"left greedy's tokens: {differ}")  # fmt: skip
    assert differ, "decode-time eviction was exact with drafts: the refusal may be lifted"

    config = SimpleNamespace(speculative_config=SimpleNamespace())
    for extra, field in ((DECODE, "kv_decode"), ({"kv_budget": 128, "kv_when": "pressure"},
                         "kv_when"), ({"kv_budget": 128, "kv_session": True}, "kv_session"),
                         ({"kv_budget": 128, "kv_pipeline": "adakv"}, "kv_pipeline")):  # fmt: skip
        options = parse_kv_options(extra, 600, 2048)
        assert admission.speculative_refusal(config, options)[0] == field, extra
    for extra in PROMPT_END.values():
        assert admission.speculative_refusal(config, parse_kv_options(extra, 600, 2048)) is None


def test_auto_starts_no_session_with_drafts(tokenizer, model_path):
    """``kv_compress_at: "auto"`` (the server policy's default) on an engine with drafts: a
    session is refused there, so "auto" must not start one the client never asked for. A
    first sighting is compressed whole (no 400 naming ``kv_session``); an explicit
    ``kv_session`` is still refused."""
    context, question, _ = needle_parts(19, seed=900)
    ids = tokenizer(context).input_ids + tokenizer(question, add_special_tokens=False).input_ids
    auto = {"kv_budget": 128, "kv_pipeline": "tova", "kv_compress_at": "auto"}
    requests = [
        {"id": "auto", "prompt_token_ids": ids, "max_tokens": 8, "extra_args": auto},
        {"id": "session", "prompt_token_ids": ids, "max_tokens": 8,
         "extra_args": {"kv_budget": 128, "kv_pipeline": "tova", "kv_session": True}},
    ]  # fmt: skip
    engine = {"model": str(model_path), **ENGINE_KWARGS, "speculative_config": SPECULATIVE}
    out = _run({"engine": engine, "requests": requests}, False, sorted(os.sched_getaffinity(0))[0])
    got = out["results"]["auto"]
    assert "error" not in got, got
    assert got["obcache"]["freed_blocks"] > 0 and "compress_at" not in got["obcache"], got
    assert out["results"]["session"].get("param") == "kv_session", out["results"]["session"]
