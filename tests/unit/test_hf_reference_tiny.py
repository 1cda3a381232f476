"""The HF-transformers reference path on a tiny random Llama (2 layers, GQA), no vLLM.

Oracles: without eviction the continuation is ``model.generate``'s greedy one; with eviction it
equals decoding over the FULL cache with the evicted entries masked out per layer and KV head
(which also pins the true RoPE positions of new tokens); the captured queries reproduce the
model's own attention outputs; kept counts follow the block rule.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

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

    # One eviction at the point, nothing generated yet: rows >= point cannot see what it dropped.
    single = SimpleNamespace(orders=[(point, True)], history=[kept], token_ids=[0])
    logits = _masked_full_pass(model, ids, single)[-1]
    torch.testing.assert_close(result.logits[0], logits.float(), rtol=1e-4, atol=1e-4)
    full = ref.prefill(model, ids, query_window=0).logits
    assert not torch.allclose(result.logits[0], full, atol=1e-3)  # eviction mattered


# --- run_evicting: eviction after prefill chunks and at decode steps ------------------------


@pytest.mark.parametrize("pipeline", ["snapkv", "tova", "h2o", "streaming"])
@pytest.mark.parametrize("compress_at", [None, 48])
def test_run_evicting_without_decode_equals_compress_and_generate(model, pipeline, compress_at):
    ids = _prompt(72, seed=5)
    opts = dataclasses.replace(_opts(24, pipeline), compress_at=compress_at)
    once = ref.compress_and_generate(model, ids, opts, block_size=BLOCK, max_new_tokens=6)
    steps = ref.run_evicting(model, ids, opts, block_size=BLOCK, max_new_tokens=6)
    assert steps.orders == [(compress_at or 72, True)]
    assert steps.token_ids == once.token_ids
    assert all(torch.equal(steps.kept[i], once.kept[i]) for i in range(NUM_LAYERS))
    torch.testing.assert_close(steps.logits, once.logits, rtol=1e-4, atol=1e-4)


def _masked_full_pass(model, ids: torch.Tensor, result) -> torch.Tensor:
    """Logits [S, V] of one full pass over prompt + generated tokens in which a query at
    position p, per layer and KV head, cannot see what the last eviction before it (an order
    at logical length <= p) dropped: positions below that length and not kept by it."""
    seq = torch.cat([ids, torch.tensor(result.token_ids[:-1], dtype=ids.dtype)])
    total, group = seq.numel(), NUM_Q_HEADS // NUM_KV_HEADS
    masks = []
    for layer in range(NUM_LAYERS):
        mask = torch.full((total, total), float("-inf")).triu(1)  # causal [S, S]
        mask = mask.expand(NUM_Q_HEADS, total, total).clone()  # [Hq, S, S]
        for (length, _), kept in zip(result.orders, result.history, strict=True):
            hidden = torch.ones(NUM_KV_HEADS, length, dtype=torch.bool)
            hidden.scatter_(1, kept[layer], False)
            hidden = hidden.repeat_interleave(group, dim=0)  # [Hq, length]
            rows = mask[:, length:, :length]  # queries at positions >= length
            rows.masked_fill_(hidden.unsqueeze(1).expand_as(rows), float("-inf"))
        masks.append(mask)
    # Later orders hide more: applying them in order leaves each row with every eviction up
    # to its position (an entry, once dropped, never comes back).

    def make(layer: int):
        def hook(module, args, kwargs):
            kwargs["attention_mask"] = masks[layer].unsqueeze(0)
            return args, kwargs

        return hook

    handles = [
        layer.self_attn.register_forward_pre_hook(make(i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.inference_mode():
            return model(input_ids=seq[None], use_cache=False).logits[0].float()
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize(
    "pipeline, scorer",
    [
        pytest.param("tova", "obcache_key", id="tova-last"),
        pytest.param("h2o", "obcache_value", id="h2o-sum"),
        pytest.param("snapkv", "obcache_joint", id="snapkv-sum"),
        pytest.param("tova", "key_norm", id="query-free"),
        pytest.param("streaming", "attn", id="streaming"),
    ],
)
@pytest.mark.parametrize("prefill_evict", [False, True])
def test_decode_and_chunk_eviction_equal_masking_the_full_cache(model, pipeline, scorer,
                                                                prefill_evict):  # fmt: skip
    """kv_decode (and kv_prefill_evict over three chunks): orders where the block rule puts
    them, K within its bounds, sinks and the recent window kept, and every logit equal to the
    full cache with each eviction's dropped entries masked from the queries after it."""
    length, new, budget = 72, 30, 20
    ids = _prompt(length, seed=6)
    opts = dataclasses.replace(_opts(budget, pipeline, scorer), decode=True,
                               prefill_evict=prefill_evict)  # fmt: skip
    ends = (32, 56) if prefill_evict else ()
    result = ref.run_evicting(model, ids, opts, block_size=BLOCK, max_new_tokens=new,
                              prefill_ends=ends)  # fmt: skip
    dead, expected = 0, []
    for length_now, prefill in [(32, True), (56, True), (72, True)] + [
        (length + t, False) for t in range(1, new)
    ]:
        if prefill and length_now < length and not prefill_evict:
            continue
        plan = plan_eviction(logical_len=length_now, budget=budget, dead_blocks=dead,
                             block_size=BLOCK)  # fmt: skip
        if plan is not None:
            expected.append((length_now, prefill))
            dead = plan.dead_after
    assert result.orders == expected
    assert sum(not p for _, p in result.orders) >= 3  # several decode evictions
    for (length_now, _), kept in zip(result.orders, result.history, strict=True):
        for idx in kept.values():
            assert budget <= idx.shape[1] < budget + BLOCK
            assert bool((idx[:, 1:] > idx[:, :-1]).all())  # sorted, unique positions
            assert bool((idx[:, : opts.sinks] == torch.arange(opts.sinks)).all())
            recent = torch.arange(length_now - opts.recent, length_now)
            assert bool((idx[:, -opts.recent :] == recent).all())
    full = _masked_full_pass(model, ids, result)
    torch.testing.assert_close(result.logits, full[length - 1 :], rtol=1e-4, atol=1e-4)
    if pipeline != "streaming":
        kept = result.history[-1]
        assert any(not torch.equal(k[0], k[1]) for k in kept.values())  # per head


def test_a_registered_pipeline_runs_in_the_reference(model):
    """Registered and nothing else: the reference asks the class for its window and mode."""
    from obcache_vllm.scoring import Pipeline, register_pipeline, unregister_pipeline
    from obcache_vllm.scoring.pipelines import _last_queries

    @dataclasses.dataclass(frozen=True)
    class LastThree(Pipeline):
        name = "last_three_ref"
        running_mode = "last"

        @property
        def window(self) -> int:
            return 3

        def prefill_scores(self, scorer, q, k, v, geom, q_pos=None, k_pos=None):
            q, q_pos, k_pos = _last_queries(3, q, k, q_pos, k_pos)
            return scorer(q, k, v, geom, q_pos, k_pos)

    register_pipeline(LastThree)
    try:
        ids = _prompt(72, seed=7)
        opts = dataclasses.replace(_opts(20, "last_three_ref"), decode=True)
        assert opts.query_window == 3
        result = ref.run_evicting(model, ids, opts, block_size=BLOCK, max_new_tokens=20)
        assert result.orders[0] == (72, True) and len(result.orders) >= 3
        full = _masked_full_pass(model, ids, result)
        torch.testing.assert_close(result.logits, full[71:], rtol=1e-4, atol=1e-4)
    finally:
        unregister_pipeline("last_three_ref")


def test_a_session_turn_continues_the_previous_runs_cache(model):
    """``run_evicting(start=...)``: a turn continues the cache the last one left (its prompt
    and output but the last token), at true positions. Without eviction that is one stock
    pass over the whole conversation; with eviction the next turn's cache starts from the
    last one's kept entries and dead blocks."""
    first = _prompt(40, seed=11)
    opts = dataclasses.replace(_opts(500), session=True)
    turn1 = ref.run_evicting(model, first, opts, block_size=BLOCK, max_new_tokens=6)
    assert turn1.orders == [] and turn1.length == 40 + 6 - 1
    second = torch.cat([first, torch.tensor(turn1.token_ids), _prompt(9, seed=12)])
    turn2 = ref.run_evicting(model, second, opts, block_size=BLOCK, max_new_tokens=6,
                             start=turn1)  # fmt: skip
    whole = ref.run_evicting(model, second, opts, block_size=BLOCK, max_new_tokens=6)
    assert turn2.token_ids == whole.token_ids
    torch.testing.assert_close(turn2.logits, whole.logits, rtol=1e-4, atol=1e-4)

    small = dataclasses.replace(_opts(20), session=True)
    turn1 = ref.run_evicting(model, first, small, block_size=BLOCK, max_new_tokens=6)
    assert turn1.dead == (40 - 20) // BLOCK
    second = torch.cat([first, torch.tensor(turn1.token_ids), _prompt(9, seed=12)])
    turn2 = ref.run_evicting(model, second, small, block_size=BLOCK, max_new_tokens=6,
                             start=turn1)  # fmt: skip
    assert turn2.orders == [(len(second), True)]  # the turn's own eviction at its prompt end
    kept = turn2.kept[0]  # true positions kept in layer 0: the turn's suffix, and turn 1's
    first_kept = set(turn1.layers[0].positions[0].tolist())
    assert set(kept[0].tolist()) <= first_kept | set(range(turn1.length, len(second)))


@pytest.mark.parametrize("pipeline", ["h2o", "tova"])
def test_a_recompute_after_preemption_continues_as_the_run_it_replays(model, pipeline):
    """``run_evicting(prompt_len=...)``: a preempted request recomputes its prompt (evicting
    at its compress point) and then its output so far, as one segment of decode-time queries.
    Where no decode-time order falls in the replayed output, that is the same cache as the
    original run's, and the continuation is the same."""
    prompt = _prompt(64, seed=21)
    opts = dataclasses.replace(_opts(24, pipeline, "obcache_value"), decode=True)
    whole = ref.run_evicting(model, prompt, opts, block_size=BLOCK, max_new_tokens=12)
    assert whole.orders[0] == (64, True)
    m = 5  # preempted after 5 tokens: 24 + 8 kept + 5 recomputed, no decode order yet
    assert all(length > 64 + m for length, prefill in whole.orders[1:])
    ids = torch.cat([prompt, torch.tensor(whole.token_ids[:m])])
    redo = ref.run_evicting(model, ids, opts, block_size=BLOCK, max_new_tokens=12 - m,
                            prompt_len=64)  # fmt: skip
    assert redo.orders[0] == (64, True)
    assert redo.token_ids == whole.token_ids[m:]
