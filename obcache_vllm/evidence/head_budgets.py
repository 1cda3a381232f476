"""Per-head budgets in the HF reference: uniform against adaptive (AdaKV), by masking.

With per-head budgets the heads of a layer keep different numbers of entries, which a cache of
[Hkv, K, D] per layer cannot hold. Here every layer keeps its full prompt cache and each
attention call adds ``-inf`` to the logits of the entries a head evicted (an attention
function registered with transformers, reading one mask per layer), which is exactly attention
over the kept entries, the softmax renormalised over them. Both allocations run through the
same path, so only the selection differs:

* **uniform**: every KV head keeps ``K`` (``Pipeline.select``, as the vLLM worker);
* **adaptive**: the layer keeps ``K * Hkv`` in all, spread by AdaKV's rule
  (:func:`obcache_vllm.scoring.allocation.adaptive_keep`) over the pipeline's scores.

A continuation is teacher-forced in one pass over the masked cache (:func:`forced_logits`),
so each arm costs one forward pass of the continuation's length.

Glossary: L prompt tokens (prefilled), Hkv KV heads, K kept per head on average, V vocabulary.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from obcache_vllm.evidence.hf_reference import Prefill
from obcache_vllm.options import KvOptions
from obcache_vllm.scoring.allocation import ALPHA, adaptive_keep

ATTENTION = "obcache_head_masked"
_MASKS: dict[int, Tensor] = {}  # layer index -> kept [Hkv, L] during a forced pass


def _masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """Eager attention plus ``-inf`` where the layer's mask says a head evicted an entry."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    kept = _MASKS.get(module.layer_idx)
    if kept is not None:
        heads, length = query.shape[1], key.shape[2]
        bias = query.new_zeros((heads, length))  # [Hq, Lk]
        evicted = ~kept.repeat_interleave(module.num_key_value_groups, 0)  # [Hq, L]
        bias[:, : kept.shape[1]].masked_fill_(evicted, float("-inf"))
        bias = bias[None, :, None, :]  # [1, Hq, 1, Lk]
        if attention_mask is not None:
            bias = attention_mask[..., :length] + bias
        attention_mask = bias
    return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout,
                                   **kw)  # fmt: skip


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _masked_attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


def layer_scores(state: Prefill, options: KvOptions) -> dict[int, Tensor]:
    """Per layer the scores [Hkv, L] the vLLM worker ranks ``state``'s prompt by at the
    compress point (``options``' pipeline and scorer, its last queries)."""
    scorer, pipeline = options.build_scoring()
    need, length = options.query_window, state.length
    out = {}
    for layer in state.layers or range(len(state.keys)):  # a hybrid model: its global layers
        q, k, v = state.queries[layer], state.keys[layer], state.values[layer]
        q = q if need < 0 else q[-need:]
        q_pos = torch.arange(length - q.shape[0], length)
        out[layer] = pipeline.prefill_scores(scorer, q, k, v, state.geometry, q_pos,
                                             torch.arange(length))  # fmt: skip
    return out


def masks(state: Prefill, options: KvOptions, keep: int, *, adaptive: bool,
          alpha: float = ALPHA, scores: dict[int, Tensor] | None = None) -> dict[int, Tensor]:
    """Per layer the kept entries [Hkv, L] of ``state``'s prompt: ``keep`` per head (uniform),
    or ``keep * Hkv`` per layer spread by AdaKV's rule (``adaptive``), ranked by
    :func:`layer_scores` (``scores``: already computed)."""
    pipeline = options.build_scoring()[1]
    scores = layer_scores(state, options) if scores is None else scores
    out = {}
    for layer, scores_ in scores.items():
        if adaptive:
            out[layer] = adaptive_keep(scores_, keep, recent=options.recent,
                                       sinks=options.sinks, alpha=alpha)  # fmt: skip
            continue
        index = pipeline.select(scores_, keep=keep, recent=options.recent, sinks=options.sinks)
        kept = torch.zeros(scores_.shape, dtype=torch.bool)
        out[layer] = kept.scatter_(1, index, True)
    return out


def served_masks(state: Prefill, options: KvOptions, block_size: int,
                 scores: dict[int, Tensor] | None = None) -> dict[int, Tensor]:
    """Per layer the kept entries [Hkv, L] of ``state``'s prompt as the vLLM worker keeps them
    for a pipeline whose heads own their memory (adakv): the same order as a uniform
    selection (``plan_eviction``), then ``select_heads`` in whole head-blocks. Empty when the
    block rule evicts nothing."""
    from obcache_vllm.eviction.heads import body_shape
    from obcache_vllm.eviction.planning import plan_eviction

    pipeline = options.build_scoring()[1]
    order = plan_eviction(logical_len=state.length, budget=options.budget, dead_blocks=0,
                          block_size=block_size)  # fmt: skip
    if order is None:
        return {}
    tail, body_blocks = body_shape(state.length, order.dead_after, block_size)
    scores = layer_scores(state, options) if scores is None else scores
    out = {}
    for layer, scores_ in scores.items():
        kept = pipeline.select_heads(scores_, tail=tail, body_blocks=body_blocks,
                                     block_size=block_size, recent=options.recent,
                                     sinks=options.sinks)  # fmt: skip
        out[layer] = positions_mask(kept, state.length)
    return out


def positions_mask(kept: list[Tensor], length: int) -> Tensor:
    """Kept positions per head (a list of index tensors) as a mask [Hkv, length]."""
    mask = torch.zeros((len(kept), length), dtype=torch.bool)
    for head, index in enumerate(kept):
        mask[head, index.long()] = True
    return mask


@torch.inference_mode()
def forced_logits(model, state: Prefill, kept: dict[int, Tensor] | None, tokens: list[int],
                  rest: Tensor | None = None) -> Tensor:  # fmt: skip
    """Logits [n, V] from which each of ``tokens`` (n) is predicted after ``state``'s prompt,
    then ``rest`` (more prompt tokens, computed on the masked cache: the query-agnostic
    setting), with ``kept`` masking the prompt cache per layer and head (None: the full cache).

    Without ``rest`` the first token comes from the prefill's own logits (the eviction runs
    after the prompt's last attention, as in vLLM).
    """
    from transformers import DynamicCache

    if state.cache is not None:  # a hybrid model: its sliding-window layers hold their window
        cache = copy.deepcopy(state.cache)
    else:
        data = [(k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0)
                 .contiguous()) for k, v in zip(state.keys, state.values, strict=True)]  # fmt: skip
        cache = DynamicCache(ddp_cache_data=data, config=model.config)
    prefix = [] if rest is None else [int(t) for t in rest.reshape(-1)]
    inputs = prefix + list(tokens[:-1])
    previous = model.config._attn_implementation
    _register()
    model.config._attn_implementation = ATTENTION
    _MASKS.clear()
    _MASKS.update(kept or {})
    try:
        positions = torch.arange(state.length, state.length + len(inputs))
        out = model(input_ids=torch.tensor([inputs]), position_ids=positions[None],
                    past_key_values=cache, use_cache=True)  # fmt: skip
    finally:
        _MASKS.clear()
        model.config._attn_implementation = previous
    logits = out.logits[0].float()  # [len(inputs), V]
    if prefix:
        return logits[len(prefix) - 1 :]
    return torch.cat([state.logits[None], logits], dim=0)


def compare(reference: Tensor, logits: Tensor) -> dict:
    """Per position KL(reference || logits) (nats) and whether the argmax agrees, averaged; the
    first position where it does not (n: never)."""
    p = torch.log_softmax(reference.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)  # [n]
    agree = reference.argmax(-1) == logits.argmax(-1)  # [n]
    misses = (~agree).nonzero()
    return {"kl": float(kl.mean()), "agree": float(agree.double().mean()),
            "first_divergence": int(misses[0]) if misses.numel() else len(agree)}  # fmt: skip
