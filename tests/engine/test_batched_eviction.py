"""Decode evictions of several requests in one step are batched; the result is the same.

Requests with equal prompt lengths and budgets evict in lockstep, so the runner groups their
orders (lifecycle._group_decode_orders) and each layer gathers, scores, selects and scatters them
in one op each (core._group_after_attention). Oracle: the same batch with grouping switched
off, every request processed alone.
"""

from __future__ import annotations

import pytest
from support.engine import POOL_BLOCKS
from support.texts import haystack

from obcache_vllm.vllm_ext.worker import lifecycle as runner_mod


def _prompts(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer(haystack(12, seed=50 + i)).input_ids[:200] for i in range(count)]


def _run(engine, prompts, kv, grouped: bool, monkeypatch, max_tokens=90):
    from vllm import SamplingParams

    groups_seen = []
    original = runner_mod._group_decode_orders

    def spy(rows, **kwargs):
        rows, groups = original(rows, **kwargs) if grouped else (tuple(rows), ())
        groups_seen.extend(len(g.rows) for g in groups)
        return rows, groups

    monkeypatch.setattr(runner_mod, "_group_decode_orders", spy)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=kv)
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)  # fmt: skip
    monkeypatch.undo()
    return [list(o.outputs[0].token_ids) for o in outs], groups_seen


@pytest.mark.parametrize(
    ("kv", "budget", "max_tokens"),
    [
        pytest.param({"kv_pipeline": "tova", "kv_scorer": "obcache_key", "kv_per_head": False},
                     64, 90, id="tova-last-query-shared"),
        pytest.param({"kv_pipeline": "h2o", "kv_scorer": "obcache_value"}, 64, 90,
                     id="h2o-summed"),
        # 64 stored decode queries are folded in (no order) before the first order at 332.
        pytest.param({"kv_pipeline": "h2o", "kv_scorer": "attn"}, 300, 150,
                     id="h2o-full-query-buffer-then-order"),
    ],
)  # fmt: skip
def test_batched_decode_evictions_equal_one_by_one(
    engine, tokenizer, monkeypatch, kv, budget, max_tokens
):
    prompts = _prompts(tokenizer, 6)
    kv = {"kv_budget": budget, "kv_decode": True, **kv}
    totals = engine.scheduler.obcache_totals
    before = totals.evictions
    alone, none_grouped = _run(engine, prompts, kv, False, monkeypatch, max_tokens)
    alone_evictions = totals.evictions - before
    together, grouped = _run(engine, prompts, kv, True, monkeypatch, max_tokens)
    assert not none_grouped and grouped and max(grouped) >= 2  # (chunked prefill staggers them)
    assert together == alone
    assert alone_evictions > 0 and totals.evictions - before == 2 * alone_evictions
    assert engine.free_blocks() == POOL_BLOCKS - 1
