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
import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from obcache_vllm.evidence.hf_reference import Prefill
from obcache_vllm.options import KvOptions
from obcache_vllm.scoring import RunningScores
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


# A causal key position no query reaches (padding of the heads shorter than the longest).
_UNSEEN = 1 << 62


@dataclass
class _HeadLayer:
    """One layer of :func:`run_evicting_heads`: each KV head's resident positions (sorted),
    how many of them (the first) an order compacted, the running scores [Hkv, W] (head h's
    in its first ``len(positions[h])`` columns), the prompt's last window queries."""

    positions: list[Tensor]
    compacted: list[int]
    running: RunningScores | None = None
    queries: Tensor | None = None


@dataclass(frozen=True)
class HeadsRun:
    """The outcome of :func:`run_evicting_heads`: ``kept`` per layer index each head's resident
    positions after the last order; ``history`` the same after every order, with ``orders``
    its (logical_len, prefill); ``token_ids`` the greedy tokens and ``logits`` [n, V] they
    were chosen from."""

    kept: dict[int, list[Tensor]]
    orders: list[tuple[int, bool]]
    history: list[dict[int, list[Tensor]]]
    token_ids: list[int]
    logits: Tensor
    # Where it ended (its prompt and every token but the last, as vLLM leaves a finished
    # request's cache): what a session's next turn continues (``start=``).
    layers: list = ()
    cache: object = None
    dead: int = 0
    length: int = 0
    # The last order's selection per layer index: each head's kept indices into its entries
    # before the order (in the order of their positions), as the worker records them.
    indices: dict[int, list[Tensor]] = dataclasses.field(default_factory=dict)


@torch.inference_mode()
def run_evicting_heads(model, input_ids: Tensor, options: KvOptions, block_size: int = 32,
                       max_new_tokens: int = 16, prompt_len: int | None = None,
                       start: HeadsRun | None = None) -> HeadsRun:  # fmt: skip
    """A pipeline whose heads own their memory (adakv), step by step with ``kv_decode``: the
    reference for the worker's per-head layout evicted again at decode.

    Every layer keeps its whole cache; each KV head's resident entries are a set of positions,
    and attention adds ``-inf`` to every other entry of that head (:func:`_masked_attention`),
    which is attention over the head's own entries, whatever their count. Decisions follow the
    worker's rule, restated on positions rather than head-blocks:

    * the block rule (``plan_eviction``) orders at the compress point, and at decode steps
      with ``kv_decode``, as for a uniform pipeline (the same blocks are freed);
    * at an order the layer's heads are re-selected by ``select_heads`` over each head's own
      entries (``lengths``), with the tail (the entries of the block new tokens go to) kept;
    * scores: the prompt's window (``head_scores``, each head pooled over its own entries);
      with ``kv_decode`` they seed the running scores at the prompt's end, and every decode
      query is scored against each head's entries and folded in (summed, or replaced);
    * causal keys: an entry an order compacted sits at the request's first resident slot
      (``dead * block_size``), below every later query; the rest at their true positions.

    ``prompt_len``: as in :func:`~obcache_vllm.evidence.hf_reference.run_evicting` (a
    preempted request recomputing its output: the tokens after the prompt are one segment of
    decode-time queries, with the block rule's order at its end). ``start``: a previous run
    whose final cache this one continues, as a session's next turn continues its per-head
    layout (``input_ids`` begins with its ``start.length`` tokens; only the rest is computed).
    Models whose every layer evicts only (no hybrid sliding-window layers).
    """
    from transformers import DynamicCache

    from obcache_vllm.eviction.heads import body_shape
    from obcache_vllm.eviction.step import RequestKvState
    from obcache_vllm.evidence.hf_reference import (
        _capturing_queries,
        _geometry,
        block_rule,
        evicting_layers,
    )

    ids = input_ids.reshape(-1)
    total = ids.numel()
    length = total if prompt_len is None else prompt_len
    point = options.compress_point(length)
    scorer, pipeline = options.build_scoring()
    mode = RequestKvState.create(options).decode_mode
    geom = _geometry(model)
    evict = evicting_layers(model)
    if len(evict) != model.config.num_hidden_layers:
        raise ValueError("per-head layouts are served on models whose every layer is global")
    window = pipeline.window
    cache = DynamicCache(config=model.config)
    layers: list[_HeadLayer] = []
    captured: dict[int, Tensor] = {}
    dead, past_point, begin = 0, False, 0
    if start is not None:
        cache = copy.deepcopy(start.cache)
        cache.crop(start.length)
        layers = [_HeadLayer([p.clone() for p in lay.positions], list(lay.compacted))
                  for lay in start.layers]  # fmt: skip
        dead, begin = start.dead, start.length
    orders: list[tuple[int, bool]] = []
    history: list[dict[int, list[Tensor]]] = []
    kept: dict[int, list[Tensor]] = {}
    indices: dict[int, list[Tensor]] = {}
    _register()
    previous = model.config._attn_implementation

    def forward(tokens: Tensor, start: int) -> Tensor:
        """Run tokens at positions start.. over each head's resident entries; last logits."""
        _MASKS.clear()
        for layer, lay in zip(evict, layers, strict=False):
            mask = torch.zeros((len(lay.positions), start), dtype=torch.bool)
            for head, pos in enumerate(lay.positions):
                mask[head, pos] = True
            _MASKS[layer] = mask
        positions = torch.arange(start, start + tokens.numel())
        model.config._attn_implementation = ATTENTION
        try:
            with _capturing_queries() as queries:
                out = model(input_ids=tokens.reshape(1, -1), position_ids=positions[None],
                            past_key_values=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
        finally:
            _MASKS.clear()
            model.config._attn_implementation = previous
        captured.update({i: queries[layer] for i, layer in enumerate(evict)})
        heads = model.config.num_key_value_heads
        for i in range(len(evict)):
            if i == len(layers):
                layers.append(_HeadLayer([torch.zeros(0, dtype=torch.int64)] * heads,
                                         [0] * heads))  # fmt: skip
            lay = layers[i]
            lay.positions = [torch.cat([pos, positions]) for pos in lay.positions]
        return out.logits[0, -1].float()

    def residents(i: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Layer i's heads padded to the longest: keys, values [W, Hkv, D], causal key
        positions [Hkv, W], lengths [Hkv]."""
        lay = layers[i]
        keys = cache.layers[evict[i]].keys[0]  # [Hkv, T, D]: every entry ever computed
        values = cache.layers[evict[i]].values[0]
        lengths = torch.tensor([len(pos) for pos in lay.positions])
        width = int(lengths.max())
        heads = len(lay.positions)
        k = keys.new_zeros((width, heads, keys.shape[-1]))
        v = values.new_zeros((width, heads, values.shape[-1]))
        k_pos = torch.full((heads, width), _UNSEEN, dtype=torch.int64)
        for h, pos in enumerate(lay.positions):
            k[: len(pos), h], v[: len(pos), h] = keys[h, pos], values[h, pos]
            k_pos[h, : len(pos)] = pos
            k_pos[h, : lay.compacted[h]] = dead * block_size
        return k, v, k_pos, lengths

    def evict_or_score(logical_len: int, prefill: bool, q_count: int) -> None:
        nonlocal dead, past_point, kept, indices
        order, past_point = block_rule(options, logical_len, prefill, past_point, point, dead,
                                       block_size)  # fmt: skip
        prompt_end = prefill and logical_len >= length
        new_kept, new_indices = {}, {}
        for i, lay in enumerate(layers):
            q_new = captured[i][-q_count:]
            if prefill and window:
                prev = lay.queries
                lay.queries = q_new if prev is None else torch.cat([prev, q_new])[-window:]
            if not (order is not None or (not prefill and options.decode)
                    or (options.decode and prompt_end)):  # fmt: skip
                continue
            k, v, k_pos, lengths = residents(i)
            valid = torch.arange(k.shape[0]) < lengths.view(-1, 1)
            if lay.running is None and options.decode:
                lay.running = RunningScores(k.shape[1], mode=mode)
            if prefill:
                q = lay.queries
                q_pos = torch.arange(logical_len - q.shape[0], logical_len)
                scores = pipeline.head_scores(scorer, q, k, v, geom, q_pos, k_pos, lengths)
                if lay.running is not None and prompt_end:
                    lay.running.reset()
                    lay.running.add(scores.masked_fill(~valid, 0.0))
            else:
                q = q_new if mode == "sum" else q_new[-1:]
                q_pos = torch.arange(logical_len - q.shape[0], logical_len)
                lay.running.add(scorer(q, k, v, geom, q_pos, k_pos).masked_fill(~valid, 0.0))
                scores = lay.running.scores
            if order is None:
                continue
            tail, body_blocks = body_shape(logical_len, order.dead_after, block_size)
            chosen = pipeline.select_heads(scores, tail=tail, body_blocks=body_blocks,
                                           block_size=block_size, recent=options.recent,
                                           sinks=options.sinks, lengths=lengths)  # fmt: skip
            lay.positions = [pos[c] for pos, c in zip(lay.positions, chosen, strict=True)]
            lay.compacted = [len(c) - tail for c in chosen]
            if lay.running is not None and lay.running.length:
                running = lay.running.scores
                fresh = running.new_zeros((len(chosen), max(len(c) for c in chosen)))
                for h, c in enumerate(chosen):
                    fresh[h, : len(c)] = running[h, c]
                lay.running.reset()
                lay.running.add(fresh)
            if logical_len >= point:
                lay.queries = None
            new_kept[evict[i]] = [pos.clone() for pos in lay.positions]
            new_indices[evict[i]] = chosen
        if order is not None:
            dead = order.dead_after
            orders.append((logical_len, prefill))
            history.append(new_kept)
            kept, indices = new_kept, new_indices

    at, logits = begin, None
    for end in sorted({point, length, total}):
        if end <= at:
            continue
        logits = forward(ids[at:end], at)
        evict_or_score(end, prefill=end <= length, q_count=end - at)
        at = end
    tokens: list[int] = []
    rows: list[Tensor] = []
    position = total
    for step in range(max_new_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        rows.append(logits)
        if step == max_new_tokens - 1:
            break
        logits = forward(torch.tensor([token]), position)
        position += 1
        evict_or_score(position, prefill=False, q_count=1)
    return HeadsRun(kept=kept, orders=orders, history=history, token_ids=tokens,
                    logits=torch.stack(rows), layers=layers, cache=cache, dead=dead,
                    length=position, indices=indices)  # fmt: skip
