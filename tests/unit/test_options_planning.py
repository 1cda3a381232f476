"""Per-request options (parse at the edge) and the block arithmetic of eviction (stdlib)."""

from __future__ import annotations

import math

import pytest

from obcache_vllm.admission import joins_session, parse_kv_options, parse_request
from obcache_vllm.eviction.planning import plan_eviction
from obcache_vllm.options import KvOptions, KvOptionsError


def test_no_budget_means_stock_request():
    assert parse_kv_options(None, 100) is None
    assert parse_kv_options({}, 100) is None
    assert parse_kv_options({"other_plugin_arg": 1}, 100) is None


@pytest.mark.parametrize(
    "budget, prompt, expected",
    [
        pytest.param(256, 1000, 256, id="int"),
        pytest.param(0.25, 1000, 250, id="fraction"),
        pytest.param(0.2501, 1000, 251, id="fraction-rounds-up"),
        pytest.param(1.0, 999, 999, id="whole-prompt"),
        pytest.param(300.0, 1000, 300, id="integral-float"),
        pytest.param(5000, 1000, 5000, id="larger-than-prompt-is-a-no-op"),
    ],
)
def test_budget_resolution(budget, prompt, expected):
    opts = parse_kv_options({"kv_budget": budget}, prompt)
    assert isinstance(opts, KvOptions) and opts.budget == expected


def test_defaults_and_overrides():
    opts = parse_kv_options(
        {"kv_budget": 64, "kv_scorer": "attn", "kv_pipeline": "h2o", "kv_window": 8,
         "kv_recent": 2, "kv_sinks": 0, "kv_decode": True},
        500,
    )
    assert opts == KvOptions(64, "attn", "h2o", 8, 2, 0, True)
    assert opts.query_window == -1
    assert parse_kv_options({"kv_budget": 64, "kv_pipeline": "tova"}, 500).query_window == 1
    assert parse_kv_options({"kv_budget": 64, "kv_pipeline": "streaming"}, 500).query_window == 0


def test_per_head_selection_is_an_option():
    assert parse_kv_options({"kv_budget": 64}, 500).build_scoring()[1].per_head is True
    shared = parse_kv_options({"kv_budget": 64, "kv_per_head": False}, 500)
    assert shared.per_head is False and shared.build_scoring()[1].per_head is False
    with pytest.raises(KvOptionsError, match="kv_per_head"):
        parse_kv_options({"kv_budget": 64, "kv_per_head": "maybe"}, 500)


def test_compress_at_is_the_eviction_point_and_the_base_of_a_fraction():
    whole = parse_kv_options({"kv_budget": 0.25}, 1000)
    assert whole.compress_at is None and whole.compress_point(1000) == 1000
    assert whole.budget == 250
    opts = parse_kv_options({"kv_budget": 0.25, "kv_compress_at": 800}, 1000)
    assert opts.compress_at == 800 and opts.compress_point(1000) == 800
    assert opts.budget == 200
    assert parse_kv_options({"kv_budget": 100, "kv_compress_at": 1000}, 1000).budget == 100


def test_a_negative_compress_at_counts_back_from_each_prompts_end():
    """One setting for prompts of any length (an evaluation harness's arm): the resolved
    options carry the absolute point, so nothing downstream sees the negative form."""
    for length in (300, 1000):
        opts = parse_kv_options({"kv_budget": 0.5, "kv_compress_at": -64}, length)
        assert opts.compress_at == length - 64 and opts.budget == math.ceil((length - 64) / 2)
    assert not joins_session(parse_request({"kv_budget": 0.5, "kv_compress_at": -64}))


@pytest.mark.parametrize(
    "extra, field",
    [
        pytest.param({"kv_budget": 0}, "kv_budget", id="zero"),
        pytest.param({"kv_budget": -5}, "kv_budget", id="negative"),
        pytest.param({"kv_budget": math.nan}, "kv_budget", id="nan"),
        pytest.param({"kv_budget": math.inf}, "kv_budget", id="inf"),
        pytest.param({"kv_budget": "128"}, "kv_budget", id="string"),
        pytest.param({"kv_budget": True}, "kv_budget", id="bool"),
        pytest.param({"kv_budget": 1.5}, "kv_budget", id="ratio-above-one"),
        pytest.param(
            {"kv_budget": 10, "kv_sinks": 4, "kv_recent": 6}, "kv_budget", id="sinks+recent"
        ),
        pytest.param({"kv_budget": 9000}, "kv_budget", id="beyond-context"),
        pytest.param({"kv_budget": 64, "kv_scorer": "nope"}, "kv_scorer", id="scorer"),
        pytest.param({"kv_budget": 64, "kv_pipeline": "nope"}, "kv_pipeline", id="pipeline"),
        pytest.param({"kv_budget": 64, "kv_window": 0}, "kv_window", id="window"),
        pytest.param({"kv_budget": 64, "kv_window": 2.5}, "kv_window", id="window-float"),
        pytest.param({"kv_budget": 64, "kv_recent": -1}, "kv_recent", id="recent"),
        pytest.param({"kv_budget": 64, "kv_decode": "yes"}, "kv_decode", id="decode"),
        pytest.param({"kv_budget": 64, "kv_bugdet": 3}, "kv_bugdet", id="unknown-field"),
        pytest.param({"kv_scorer": "attn"}, "kv_scorer", id="option-without-budget"),
        pytest.param({"kv_budget": 64, "kv_compress_at": 0}, "kv_compress_at", id="compress-0"),
        pytest.param(
            {"kv_budget": 64, "kv_compress_at": 1001}, "kv_compress_at", id="compress-past-prompt"
        ),
        pytest.param(
            {"kv_budget": 64, "kv_compress_at": "500"}, "kv_compress_at", id="compress-string"
        ),
        pytest.param(
            {"kv_budget": 64, "kv_compress_at": -1000}, "kv_compress_at", id="compress-before-start"
        ),
        pytest.param(
            {"kv_budget": 64, "kv_compress_at": -2.5}, "kv_compress_at", id="compress-neg-float"
        ),
    ],
)
def test_bad_values_name_the_field(extra, field):
    with pytest.raises(KvOptionsError) as info:
        parse_kv_options(extra, 1000, max_model_len=8192)
    assert info.value.field == field
    assert str(info.value).startswith(field)


@pytest.mark.parametrize("logical_len", [1, 31, 32, 100, 257, 1000, 4095])
@pytest.mark.parametrize("budget", [21, 64, 100, 256])
@pytest.mark.parametrize("dead", [0, 1, 3])
def test_plan_keeps_budget_to_budget_plus_block(logical_len, budget, dead):
    bs = 32
    if dead * bs > logical_len:
        with pytest.raises(ValueError):
            plan_eviction(logical_len=logical_len, budget=budget, dead_blocks=dead, block_size=bs)
        return
    order = plan_eviction(logical_len=logical_len, budget=budget, dead_blocks=dead, block_size=bs)
    resident = logical_len - dead * bs
    if resident - budget < bs:
        assert order is None  # no whole block to free
        return
    assert order.dead_before == dead and order.dead_after > dead
    assert budget <= order.kept < budget + bs
    assert order.kept == logical_len - order.dead_after * bs
    assert order.tokens_evicted == resident - order.kept == order.blocks_freed * bs


def test_peak_counts_the_prompt_after_the_compress_point_kept_whole():
    """Found by the scheduler harness: with kv_prefill_evict and kv_compress_at, the prompt
    after the point is computed on the compressed cache with no order running, so it is held
    whole; the peak counted only the bounded chunks, admitted a request that could never
    fit the pool, and it waited forever."""
    from obcache_vllm.eviction.planning import peak_blocks

    common = dict(prompt_len=204, max_tokens=1, block_size=8, chunk=48, budget=71,
                  prefill_evict=True)  # fmt: skip
    assert peak_blocks(**common) == math.ceil((71 + 7 + 48) / 8)  # the bounded chunks
    # 78 kept at the point, then 118 more tokens: 196 tokens resident when the prompt ends
    assert peak_blocks(**common, point=86) == math.ceil((71 + 7 + 204 - 86) / 8)
    assert peak_blocks(**common, point=204) == peak_blocks(**common)
