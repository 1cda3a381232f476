"""The HF-transformers reference path on a tiny random Llama (2 layers, GQA), no vLLM.

Oracles: without eviction the continuation is ``model.generate``'s greedy one; with eviction it
equals decoding over the FULL cache with the evicted entries masked out per layer and KV head
(which also pins the true RoPE positions of new tokens); the captured queries reproduce the
model's own attention outputs; kept counts follow the block rule.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from obcache_vllm.eviction.planning import plan_eviction
from obcache_vllm.evidence import hf_reference as ref
from obcache_vllm.options import KvOptions

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS, VOCAB = 4, 2, 16, 2, 96
BLOCK = 8


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=NUM_Q_HEADS * HEAD_DIM,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_Q_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention than the default init, so scores differ a lot
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    # Tiny ops: one thread avoids OpenMP spin-waits on a busy 2-core machine (10x here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model
    torch.set_num_threads(threads)


def _prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _opts(budget: int, pipeline: str = "snapkv", scorer: str = "obcache_key") -> KvOptions:
    return KvOptions(budget=budget, scorer=scorer, pipeline=pipeline, window=8, recent=4, sinks=2)


@pytest.mark.parametrize(
    "length, budget",
    [
        pytest.param(60, 100, id="budget-above-prompt"),
        pytest.param(60, 60, id="budget-equals-prompt"),
        pytest.param(60, 53, id="less-than-a-block-over"),
    ],
)
def test_no_eviction_continuation_equals_generate(model, length, budget) -> None:
    from transformers import GenerationConfig

    ids = _prompt(length)
    result = ref.compress_and_generate(
        model, ids, _opts(budget), block_size=BLOCK, max_new_tokens=10
    )
    assert result.order is None and result.kept == {} and result.num_kept is None

    config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None)
    expected = model.generate(ids[None], generation_config=config)[0, length:].tolist()
    assert result.token_ids == expected
    assert result.logits.shape == (10, VOCAB)


@pytest.mark.parametrize(
    "length, budget",
    [
        pytest.param(64, 24, id="exact-blocks"),
        pytest.param(70, 24, id="partial-tail-block"),
        pytest.param(45, 20, id="one-block-over"),
    ],
)
@pytest.mark.parametrize("pipeline", ["snapkv", "tova", "h2o", "streaming"])
def test_kept_count_follows_block_rule(model, length, budget, pipeline) -> None:
    opts = _opts(budget, pipeline)
    state = ref.prefill(model, _prompt(length), query_window=opts.query_window)
    order, kept = ref.select_kept(state, opts, block_size=BLOCK)

    plan = plan_eviction(logical_len=length, budget=budget, dead_blocks=0, block_size=BLOCK)
    assert order == plan and order is not None
    assert budget <= order.kept < budget + BLOCK
    assert sorted(kept) == list(range(NUM_LAYERS))
    for idx in kept.values():
        assert idx.shape == (NUM_KV_HEADS, order.kept) and idx.dtype == torch.long
        assert bool((idx[:, 1:] > idx[:, :-1]).all())  # sorted, unique
        assert bool((idx[:, : opts.sinks] == torch.arange(opts.sinks)).all())
        recent = torch.arange(length - opts.recent, length)
        assert bool((idx[:, -opts.recent :] == recent).all())


def _mask_evicted_hooks(model, kept: dict[int, torch.Tensor], prompt_len: int):
    """Pre-hooks hiding, per layer and KV head, the prompt entries not in ``kept``."""
    group = NUM_Q_HEADS // NUM_KV_HEADS

    def make(layer: int):
        hidden = torch.ones(NUM_KV_HEADS, prompt_len, dtype=torch.bool)  # [Hkv, L]
        hidden.scatter_(1, kept[layer], False)
        hidden = hidden.repeat_interleave(group, dim=0)  # [Hq, L]  query head h -> KV h // G

        def hook(module, args, kwargs):
            q_len = kwargs["hidden_states"].shape[1]
            kv_len = kwargs["past_key_values"].get_seq_length(layer) + q_len
            assert q_len == 1
            mask = torch.zeros(1, NUM_Q_HEADS, 1, kv_len)  # [1, Hq, 1, kv]
            mask[0, :, 0, :prompt_len].masked_fill_(hidden, float("-inf"))
            kwargs["attention_mask"] = mask
            return args, kwargs

        return hook

    return [
        layer.self_attn.register_forward_pre_hook(make(i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]


@pytest.mark.parametrize(
    "pipeline, scorer",
    [
        pytest.param("snapkv", "obcache_key", id="snapkv-obcache_key"),
        pytest.param("tova", "attn", id="tova-attn"),
        pytest.param("h2o", "obcache_value", id="h2o-obcache_value"),
        pytest.param("streaming", "attn", id="streaming"),
    ],
)
def test_eviction_equals_masking_the_full_cache(model, pipeline, scorer) -> None:
    length, new = 72, 8
    opts = _opts(24, pipeline, scorer)
    state = ref.prefill(model, _prompt(length, seed=1), query_window=-1)
    order, kept = ref.select_kept(state, opts, block_size=BLOCK)
    assert order is not None and order.kept == 24
    # Heads keep different entries for the scored pipelines (per-head selection really happens).
    if pipeline != "streaming":
        assert any(not torch.equal(k[0], k[1]) for k in kept.values())

    tokens, logits = ref.generate(model, state, kept, max_new_tokens=new)
    handles = _mask_evicted_hooks(model, kept, length)
    try:
        masked_tokens, masked_logits = ref.generate(model, state, None, max_new_tokens=new)
    finally:
        for handle in handles:
            handle.remove()
    full_tokens, full_logits = ref.generate(model, state, None, max_new_tokens=new)

    torch.testing.assert_close(logits, masked_logits, rtol=1e-4, atol=1e-4)
    assert tokens == masked_tokens
    assert torch.equal(logits[0], full_logits[0])  # the first token saw the full prompt
    assert not torch.allclose(logits[1:], full_logits[1:], atol=1e-3)  # eviction mattered


def test_captured_queries_reproduce_the_attention_outputs(model) -> None:
    length, window = 40, 6
    ids = _prompt(length, seed=2)
    outputs = {}

    def grab(i):
        def hook(module, args):
            outputs[i] = args[0][0, -window:].view(window, NUM_Q_HEADS, HEAD_DIM)  # [W, Hq, D]

        return hook

    handles = [
        layer.self_attn.o_proj.register_forward_pre_hook(grab(i))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        state = ref.prefill(model, ids, query_window=window)
    finally:
        for handle in handles:
            handle.remove()
    assert state.length == length
    group, scale = NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM**-0.5
    causal = torch.arange(length)[None, :] <= torch.arange(length - window, length)[:, None]
    for i in range(NUM_LAYERS):
        q, k, v = state.queries[i], state.keys[i], state.values[i]
        assert q.shape == (window, NUM_Q_HEADS, HEAD_DIM)
        assert k.shape == v.shape == (length, NUM_KV_HEADS, HEAD_DIM)
        k_q = k.repeat_interleave(group, dim=1)  # [L, Hq, D]  query head h reads KV head h // G
        v_q = v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        logits = torch.einsum("whd,thd->hwt", q, k_q) * scale  # [Hq, W, L]
        probs = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # [Hq, W, L]
        out = torch.einsum("hwt,thd->whd", probs, v_q)  # [W, Hq, D]
        torch.testing.assert_close(out, outputs[i], rtol=1e-4, atol=1e-5)


def test_select_kept_refuses_missing_queries(model) -> None:
    state = ref.prefill(model, _prompt(48), query_window=4)
    with pytest.raises(ValueError, match="query_window"):
        ref.select_kept(state, _opts(16, "h2o", "attn"), block_size=BLOCK)
    with pytest.raises(ValueError, match="query_window"):
        ref.select_kept(state, _opts(16, "snapkv"), block_size=BLOCK)  # window 8 > 4 captured


def test_compress_at_without_eviction_equals_generate(model) -> None:
    from transformers import GenerationConfig

    ids = _prompt(60, seed=3)
    opts = dataclasses.replace(_opts(100), compress_at=40)
    result = ref.compress_and_generate(model, ids, opts, block_size=BLOCK, max_new_tokens=6)
    assert result.order is None
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert result.token_ids == model.generate(ids[None], generation_config=config)[0, 60:].tolist()


@pytest.mark.parametrize("pipeline", ["snapkv", "h2o"])
def test_compress_at_scores_the_prefix_and_the_rest_sees_only_kept_entries(model, pipeline):
    """Oracle: one full pass in which prompt rows >= k cannot see the prefix entries evicted."""
    length, point = 72, 48
    ids = _prompt(length, seed=4)
    opts = dataclasses.replace(_opts(24, pipeline), compress_at=point)
    result = ref.compress_and_generate(model, ids, opts, block_size=BLOCK, max_new_tokens=1)
    prefix = ref.prefill(model, ids[:point], query_window=-1)
    order, kept = ref.select_kept(prefix, opts, block_size=BLOCK)
    assert result.order == order and order.logical_len == point
    assert all(torch.equal(result.kept[i], kept[i]) for i in kept)  # the rest is not scored

    group = NUM_Q_HEADS // NUM_KV_HEADS

    def make(layer: int):
        mask = torch.full((length, length), float("-inf")).triu(1)  # causal [L, L]
        mask = mask.expand(NUM_Q_HEADS, length, length).clone()  # [Hq, L, L]
        hidden = torch.ones(NUM_KV_HEADS, point, dtype=torch.bool)
        hidden.scatter_(1, kept[layer], False)
        hidden = hidden.repeat_interleave(group, dim=0)  # [Hq, k]
        rows = mask[:, point:, :point]  # [Hq, L-k, k]
        rows.masked_fill_(hidden.unsqueeze(1).expand_as(rows), float("-inf"))

        def hook(module, args, kwargs):
            kwargs["attention_mask"] = mask.unsqueeze(0)
            return args, kwargs

        return hook

    handles = [
        layer.self_attn.register_forward_pre_hook(make(i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.inference_mode():
            logits = model(input_ids=ids[None], use_cache=False).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(result.logits[0], logits.float(), rtol=1e-4, atol=1e-4)
    full = ref.prefill(model, ids, query_window=0).logits
    assert not torch.allclose(result.logits[0], full, atol=1e-3)  # eviction mattered
