"""The same eviction in HF transformers: a reference for the vLLM path, and scorers without vLLM.

This module imports torch and transformers only. It runs a decoder-only model with eager
attention (any architecture whose layers dispatch through transformers' attention interface:
the queries are read there, after the projections, QK-norm and RoPE; the matrix of
``obcache_vllm/evidence/architectures.py`` checks Llama, Qwen2/3, Mistral, Phi-3, OLMo 2,
Granite), applies exactly the decision the vLLM worker makes at the end of the prefill
(same scorer, same pipeline, same block rule, same sinks/recent window), keeps the selected
entries per layer and KV head in a ``DynamicCache``, and continues greedily::

    import torch
    from obcache_vllm.evidence import hf_reference as ref
    from obcache_vllm.options import KvOptions

    model, tok = ref.load_model("~/.cache/obcache-vllm/models/SmolLM2-135M-Instruct")
    ids = tok.apply_chat_template([{"role": "user", "content": long_text}],
                                  add_generation_prompt=True, return_tensors="pt")["input_ids"]
    opts = KvOptions(budget=256, scorer="obcache_key", pipeline="snapkv", window=32)
    result = ref.compress_and_generate(model, ids[0], opts, block_size=32, max_new_tokens=32)
    print(tok.decode(result.token_ids), result.num_kept, result.kept[0].shape)  # [Hkv, K]

To compare several options on one prompt, run the prompt once (:func:`prefill` with
``query_window=-1`` keeps every query) and call :func:`select_kept` and :func:`generate`
per option set. ``block_size`` only matters for the kept count K: vLLM frees whole blocks, so
``budget <= K < budget + block_size`` (see :mod:`obcache_vllm.eviction.planning`); use the
block size of the vLLM engine you compare with (32 in the tests).

What matches vLLM, step by step:

1. The prompt goes through the model once with the full cache (as vLLM's prefill); the first
   new token comes from the last prompt position's logits, which attended to every token.
2. Per layer, the post-RoPE queries of the prompt (the last W for ``snapkv``, the last one for
   ``tova``, all of them for ``h2o``) and the cached post-RoPE keys and values [L, Hkv, D] go
   through ``pipeline.prefill_scores`` then ``pipeline.select(keep=K, recent, sinks)``.
3. Each layer's cache is replaced by the kept entries [1, Hkv, K, D] (heads may keep different
   tokens; all keep K). Kept keys carry their original rotation, so positions stay true.
4. Decoding feeds one token at a time with its TRUE position ``L + t`` (HF would otherwise
   derive ``K + t`` from the cache length). One query over K + t + 1 entries needs no mask.

:func:`run_evicting` covers the rest of what the worker does, one step at a time: eviction
after prefill chunks (``kv_prefill_evict``), at the compress point and at every decode step
(``kv_decode``, with the pipeline's running scores), on a cache whose heads each hold their own
entries and true positions.

Glossary: L prompt tokens, W window queries, K kept per head, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from obcache_vllm.eviction.messages import EvictionOrder
from obcache_vllm.eviction.planning import plan_eviction
from obcache_vllm.eviction.quantized import fp8_format, is_quantized, quantize_like_cpu
from obcache_vllm.eviction.step import RequestKvState
from obcache_vllm.options import KvOptions
from obcache_vllm.scoring import HeadGeometry, Pipeline, RunningScores, Scorer

__all__ = [
    "Prefill",
    "Result",
    "compress_and_generate",
    "evicting_layers",
    "generate",
    "load_model",
    "make_scoring",
    "new_cache",
    "prefill",
    "run_evicting",
    "select_kept",
]


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from a local HF directory, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def make_scoring(options: KvOptions) -> tuple[Scorer, Pipeline]:
    """The scorer and pipeline the vLLM worker builds for ``options`` (the same call)."""
    return options.build_scoring()


@dataclass(frozen=True)
class Prefill:
    """The prompt's full-cache pass: what every eviction decision and continuation starts from.

    ``keys``/``values``: per layer [L, Hkv, D] (post-RoPE keys). ``queries``: per layer the last
    ``min(W, L)`` post-RoPE queries [W, Hq, D] (all L when captured with ``query_window=-1``).
    ``logits``: the last prompt position's logits [V] (full cache).
    """

    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    queries: tuple[Tensor, ...]
    logits: Tensor
    geometry: HeadGeometry
    # The layers a budget evicts in (:func:`evicting_layers`): every layer, or a hybrid
    # model's global ones. Its sliding-window layers hold their window only (``keys`` as HF's
    # cache leaves them) and continue from ``cache``, the prefill's own HF cache.
    layers: tuple[int, ...] = ()
    cache: object = None

    @property
    def length(self) -> int:
        """L: prompt tokens."""
        return self.keys[self.layers[0] if self.layers else 0].shape[0]


@dataclass(frozen=True)
class Result:
    """One compressed continuation.

    ``kept``: per layer index the sorted kept prompt positions per KV head, LongTensor [Hkv, K]
    (empty when no whole block could be evicted: then the cache stayed full, as in vLLM).
    ``token_ids``: the greedy continuation. ``logits``: [n, V], the logits each token was
    chosen from (row 0: full cache). ``order``: the block plan (None: no eviction).
    """

    kept: dict[int, Tensor]
    token_ids: list[int]
    logits: Tensor
    order: EvictionOrder | None

    @property
    def num_kept(self) -> int | None:
        """K per layer and KV head, or None when nothing was evicted."""
        return self.order.kept if self.order is not None else None


def _attention_modules(model) -> list:
    layers = model.model.layers
    return [layer.self_attn for layer in layers]


def evicting_layers(model) -> tuple[int, ...]:
    """The layers a budget evicts in, as vLLM's group of global layers holds them
    (:mod:`obcache_vllm.vllm_ext.groups`): every layer, or for a model that interleaves
    sliding-window and global layers (``layer_types``: Gemma 2 and 3) the global ones, in
    layer order (the worker's layer index ``i`` is ``evicting_layers(model)[i]``). A layer that
    reads another layer's KV cache (Gemma 3n's KV-sharing layers) has none to evict in."""
    cfg = model.config.get_text_config()
    attn = _attention_modules(model)
    owners = [i for i, a in enumerate(attn) if not getattr(a, "is_kv_shared_layer", False)]
    kinds = getattr(cfg, "layer_types", None)
    if getattr(cfg, "sliding_window", None) is None or not kinds:
        return tuple(owners)
    return tuple(i for i in owners if kinds[i] == "full_attention")


def _geometry(model) -> HeadGeometry:
    cfg = model.config
    attn = _attention_modules(model)[0]
    return HeadGeometry(
        num_q_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=attn.head_dim,
        scale=attn.scaling,
    )


@contextlib.contextmanager
def _capturing_queries(keep: int | None = None):
    """The queries every attention layer attends with, by layer index: [n, Hq, D] as the model
    hands them to its attention function (after the projection, any QK-norm and RoPE), the
    last ``keep`` of the call (None: all). Read at transformers' attention interface, which
    every decoder dispatches through (eager and SDPA alike), so no architecture's projection
    layout (fused QKV, norms before RoPE) is restated here."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    captured: dict[int, Tensor] = {}
    original = ALL_ATTENTION_FUNCTIONS.get_interface

    def get_interface(attn_implementation, default):
        inner = original(attn_implementation, default)

        def attend(module, query, *args, **kwargs):
            q = query[0].transpose(0, 1)  # [n, Hq, D]
            captured[module.layer_idx] = (q if keep is None else q[q.shape[0] - keep :]).clone()
            return inner(module, query, *args, **kwargs)

        return attend

    ALL_ATTENTION_FUNCTIONS.get_interface = get_interface  # this instance only
    try:
        yield captured
    finally:
        del ALL_ATTENTION_FUNCTIONS.get_interface


@functools.cache
def _quantizing_cache(fmt: torch.dtype):
    """A ``DynamicCache`` that stores what vLLM's CPU kernel stores for an fp8 KV cache: every
    key and value the model writes goes through :func:`quantize_like_cpu` (scale 1.0, vLLM's
    when the checkpoint ships no scales), and every attention reads those values, as the CPU
    backend's attention reads the cache for prefill and decode alike."""
    from transformers import DynamicCache

    class QuantizedKvCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(quantize_like_cpu(key_states, fmt),
                                  quantize_like_cpu(value_states, fmt), layer_idx, *args,
                                  **kwargs)  # fmt: skip

    return QuantizedKvCache


def new_cache(model, data=None, kv_cache_dtype: str = "auto"):
    """An HF cache for ``model`` holding ``data`` (per layer (keys, values) [1, Hkv, T, D],
    taken as they are), storing new entries as a vLLM ``--kv-cache-dtype`` cache would."""
    from transformers import DynamicCache

    fmt = fp8_format(kv_cache_dtype)
    if fmt is None and is_quantized(kv_cache_dtype):
        raise ValueError(f"the reference models fp8 KV caches only, not {kv_cache_dtype!r}")
    cls = DynamicCache if fmt is None else _quantizing_cache(fmt)
    return cls(ddp_cache_data=data or None, config=model.config)


@torch.inference_mode()
def prefill(model, input_ids: Tensor, query_window: int = -1,
            kv_cache_dtype: str = "auto") -> Prefill:  # fmt: skip
    """Run the prompt once (full cache) and capture queries, keys and values of every layer.

    ``input_ids``: LongTensor [L] or [1, L]. ``query_window``: how many last queries to keep
    per layer (-1: all; ``KvOptions.query_window`` gives what a pipeline needs; 0: none).
    ``kv_cache_dtype``: vLLM's ``--kv-cache-dtype`` ("fp8", "fp8_e5m2"): the keys and values
    are stored, attended and returned as that cache holds them (:func:`new_cache`).
    """
    ids = input_ids.reshape(1, -1).to(model.device)  # [1, L]
    num_tokens = ids.shape[1]
    modules = _attention_modules(model)
    geom = _geometry(model)
    keep = num_tokens if query_window < 0 else min(query_window, num_tokens)
    with _capturing_queries(keep) as captured:
        out = model(input_ids=ids, past_key_values=new_cache(model, None, kv_cache_dtype),
                    use_cache=True, logits_to_keep=1)  # fmt: skip
    if not keep:
        captured.clear()
    cache = out.past_key_values
    keys, values = [], []
    for layer in cache.layers[: len(modules)]:
        keys.append(layer.keys[0].transpose(0, 1).contiguous())  # [L, Hkv, D]
        values.append(layer.values[0].transpose(0, 1).contiguous())  # [L, Hkv, D]
    empty = torch.empty(0, geom.num_q_heads, geom.head_dim, dtype=keys[0].dtype)
    queries = tuple(captured.get(i, empty) for i in range(len(modules)))
    layers = evicting_layers(model)
    return Prefill(
        keys=tuple(keys),
        values=tuple(values),
        queries=queries,
        logits=out.logits[0, -1].float(),  # [V]
        geometry=geom,
        layers=layers,
        cache=cache if len(layers) < len(modules) else None,
    )


def select_kept(
    state: Prefill, options: KvOptions, block_size: int = 32
) -> tuple[EvictionOrder | None, dict[int, Tensor]]:
    """The block plan and the kept positions per layer, LongTensor [Hkv, K], as vLLM decides.

    Empty dict when the block rule evicts nothing. Needs the queries ``options`` asks for
    (``options.query_window`` last ones; all for h2o) in ``state``.
    """
    order = plan_eviction(
        logical_len=state.length, budget=options.budget, dead_blocks=0, block_size=block_size
    )
    if order is None:
        return None, {}
    scorer, pipeline = make_scoring(options)
    need = options.query_window
    kept = {}
    for layer in state.layers or range(len(state.keys)):
        q, k, v = state.queries[layer], state.keys[layer], state.values[layer]
        if need != 0:
            have = q.shape[0]
            if (need < 0 and have < state.length) or have < min(need, state.length):
                raise ValueError(
                    f"layer {layer}: {have} queries captured, pipeline {options.pipeline!r} "
                    f"needs {'all' if need < 0 else need}; call prefill with a larger query_window"
                )
            q = q if need < 0 else q[-need:]  # [W, Hq, D]
        q_pos = torch.arange(state.length - q.shape[0], state.length)  # [W]
        k_pos = torch.arange(state.length)  # [L]
        scores = pipeline.prefill_scores(scorer, q, k, v, state.geometry, q_pos, k_pos)  # [Hkv, L]
        kept[layer] = pipeline.select(
            scores, keep=order.kept, recent=options.recent, sinks=options.sinks
        )  # [Hkv, K]
    return order, kept


@torch.inference_mode()
def generate(
    model,
    state: Prefill,
    kept: dict[int, Tensor] | None = None,
    max_new_tokens: int = 16,
    eos_token_ids: Collection[int] = (),
    rest: Tensor | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[list[int], Tensor]:
    """Greedy continuation from the prefill with only the ``kept`` entries cached per layer.

    ``kept`` None or empty: the full prompt cache. ``rest``: prompt tokens [R] that follow the
    prefilled ones (``kv_compress_at``): computed in one pass on the compressed cache at their
    true positions, the first new token then comes from their last logits. Returns the tokens
    and the logits [n, V] each was chosen from. Stops after an ``eos_token_ids`` token (none by
    default: exactly ``max_new_tokens`` tokens). ``kv_cache_dtype``: as in :func:`prefill`
    (give the prefill's).
    """
    data = []
    for layer, (k, v) in enumerate(zip(state.keys, state.values, strict=True)):
        k_heads, v_heads = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]
        if kept and layer in kept:
            index = kept[layer].unsqueeze(-1).expand(-1, -1, k.shape[-1])  # [Hkv, K, D]
            k_heads = torch.gather(k_heads, 1, index)  # [Hkv, K, D]
            v_heads = torch.gather(v_heads, 1, index)  # [Hkv, K, D]
        data.append((k_heads.unsqueeze(0).contiguous(), v_heads.unsqueeze(0).contiguous()))
    if state.cache is not None:
        # A hybrid model: its sliding-window layers go on from their own window (HF's cache
        # layer knows the positions it holds), the global layers from their kept entries.
        cache = copy.deepcopy(state.cache)
        for layer in state.layers:
            cache.layers[layer].keys, cache.layers[layer].values = data[layer]
    else:
        cache = new_cache(model, data, kv_cache_dtype)

    logits = state.logits
    position = state.length
    if rest is not None and rest.numel():
        rest = rest.reshape(1, -1).to(model.device)  # [1, R]
        positions = torch.arange(position, position + rest.shape[1], device=model.device)
        out = model(
            input_ids=rest,
            position_ids=positions.unsqueeze(0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[0, -1].float()  # [V]
        position += rest.shape[1]
    tokens: list[int] = []
    rows: list[Tensor] = []
    stop = set(eos_token_ids)
    for step in range(max_new_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        rows.append(logits)
        if token in stop or step == max_new_tokens - 1:
            break
        out = model(
            input_ids=torch.tensor([[token]], device=model.device),
            position_ids=torch.tensor([[position]], device=model.device),  # true position
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits[0, -1].float()  # [V]
        position += 1
    empty = state.logits.new_empty((0, state.logits.shape[0]))
    return tokens, torch.stack(rows) if rows else empty


def compress_and_generate(
    model,
    input_ids: Tensor,
    options: KvOptions,
    block_size: int = 32,
    max_new_tokens: int = 16,
    eos_token_ids: Collection[int] = (),
    kv_cache_dtype: str = "auto",
    prefilled: Prefill | None = None,
) -> Result:
    """Prefill, evict as vLLM would, and continue greedily.

    Eviction runs at the end of the prompt, or after ``options.compress_at`` prompt tokens: the
    remaining prompt tokens are then computed on the compressed cache, as in vLLM.
    ``prefilled``: a prefill of the prompt up to that point with at least the pipeline's window
    of queries (``query_window=-1`` keeps them all), shared by requests of one prefix (each
    pipeline takes its own window from it); None: prefilled here.
    """
    ids = input_ids.reshape(-1)
    point = options.compress_point(ids.numel())
    state = prefilled if prefilled is not None else prefill(
        model, ids[:point], query_window=options.query_window, kv_cache_dtype=kv_cache_dtype)
    order, kept = select_kept(state, options, block_size)
    tokens, logits = generate(model, state, kept, max_new_tokens, eos_token_ids, ids[point:],
                              kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    return Result(kept=kept, token_ids=tokens, logits=logits, order=order)


@dataclass
class _Layer:
    """One layer's compressed cache in the step-by-step reference."""

    keys: Tensor  # [Hkv, T, D]
    values: Tensor  # [Hkv, T, D]
    positions: Tensor  # [Hkv, T] true positions of the resident entries
    queries: Tensor | None = None  # the last window prompt queries [<= W, Hq, D]
    running: RunningScores | None = None


@dataclass(frozen=True)
class Evicting:
    """The outcome of :func:`run_evicting`.

    ``kept``: per layer the true positions [Hkv, K] of the entries the last eviction kept
    (empty dict: nothing was evicted). ``orders``: (logical_len, prefill) of every eviction,
    ``history`` its kept positions (per layer [Hkv, K]). ``token_ids``/``logits`` as in
    :class:`Result`.
    """

    kept: dict[int, Tensor]
    orders: list[tuple[int, bool]]
    history: list[dict[int, Tensor]]
    token_ids: list[int]
    logits: Tensor
    # The cache when it ended (its prompt and every token but the last, as vLLM leaves a
    # finished request's cache): what a session's next turn continues (``start=``).
    layers: list = ()
    dead: int = 0
    length: int = 0


def block_rule(options: KvOptions, logical_len: int, prefill: bool, past_point: bool, point: int,
               dead: int, block_size: int) -> tuple[EvictionOrder | None, bool]:  # fmt: skip
    """The scheduler's block rule after one step that leaves ``logical_len`` tokens: the order
    (None: no whole block goes) and whether the compress point has been passed. Before the
    point only with ``kv_prefill_evict``, at it always, after it at decode steps with
    ``kv_decode`` (as :meth:`obcache_vllm.eviction.ledger.RequestBlocks.can_compact`)."""
    order = None
    if not past_point:
        if logical_len >= point or options.prefill_evict:
            order = plan_eviction(logical_len=logical_len, budget=options.budget,
                                  dead_blocks=dead, block_size=block_size)  # fmt: skip
        past_point = logical_len >= point
    elif options.decode and not prefill:
        order = plan_eviction(logical_len=logical_len, budget=options.budget, dead_blocks=dead,
                              block_size=block_size)  # fmt: skip
    return order, past_point


@torch.inference_mode()
def run_evicting(
    model,
    input_ids: Tensor,
    options: KvOptions,
    block_size: int = 32,
    max_new_tokens: int = 16,
    prefill_ends: Collection[int] = (),
    eos_token_ids: Collection[int] = (),
    start: Evicting | None = None,
    prompt_len: int | None = None,
    kv_cache_dtype: str = "auto",
) -> Evicting:
    """The worker's eviction step by step: prefill segments, compress point, decode steps.

    ``start``: a previous run whose final cache this one continues, as a ``kv_session`` turn
    continues the cache its last turn left: ``input_ids`` begins with that run's first
    ``start.length`` tokens; only the rest is computed, at its true positions, on the
    previous run's kept entries and dead blocks (the window queries are this run's own, as
    the adopting request's worker has only those).

    ``prompt_len``: the request's prompt when ``input_ids`` also holds output tokens it
    recomputes, as a preempted request does: the compress point and the prompt's end are the
    prompt's, and the tokens after the prompt are one segment of decode-time queries, folded
    into the running scores as decode queries are (all of them summed; the last one for
    "last"), with the block rule's decode-time order at its end.

    The prompt is computed in segments ending at each of ``prefill_ends`` (the prefill chunks
    that ended where the engine evicted with ``kv_prefill_evict``: where vLLM cuts a prompt
    into chunks is the scheduler's choice, not the eviction's), the compress point and the
    prompt's end. After each segment and each decoded token the block rule decides, exactly
    as the scheduler's ledger does: before the compress point only with ``kv_prefill_evict``,
    at it always, after it at decode steps with ``kv_decode``. Scores follow the worker:

    * window pipelines (snapkv, tova) score with the last ``window`` prompt queries seen so
      far; with ``kv_decode`` those scores seed the running scores at the prompt's end;
    * h2o adds every prompt query's scores segment by segment (its running sum);
    * each decode query is scored against the resident entries and folded into the running
      scores (summed, or replaced for tova and query-free scorers).

    The causal key of resident j is its logical slot ``dead * block_size + j``, as in the
    worker: exact whenever every scored query came after the last compaction, which holds
    for decode queries and for prefill windows no longer than the chunk they end.

    ``kv_cache_dtype``: as in :func:`prefill`.
    """
    ids = input_ids.reshape(-1)
    total = ids.numel()
    length = total if prompt_len is None else prompt_len  # the prompt
    point = options.compress_point(length)
    scorer, pipeline = make_scoring(options)
    mode = RequestKvState.create(options).decode_mode
    geom = _geometry(model)
    modules = _attention_modules(model)
    window = pipeline.window  # None: every prompt query (h2o)
    layers: list[_Layer] = []  # the layers a budget evicts in, in order (evicting_layers)
    evict = evicting_layers(model)
    # A hybrid model's own cache across steps: its sliding-window layers keep their window
    # there; its global layers are written from ``layers`` before every forward pass.
    native = new_cache(model, None, kv_cache_dtype) if len(evict) < len(modules) else None
    if native is not None and start is not None:
        raise ValueError("sessions are not served on hybrid sliding-window models")
    captured: dict[int, Tensor] = {}
    dead, past_point = 0, False
    begin = 0
    if start is not None:
        layers = [_Layer(lay.keys.clone(), lay.values.clone(), lay.positions.clone())
                  for lay in start.layers]  # fmt: skip
        dead, begin = start.dead, start.length
    ends = sorted({e for e in prefill_ends if begin < e < point} | {point, length, total})
    orders: list[tuple[int, bool]] = []
    history: list[dict[int, Tensor]] = []
    kept: dict[int, Tensor] = {}

    def forward(tokens: Tensor, start: int) -> Tensor:
        """Run tokens [n] at positions start.. on the resident cache; returns last logits."""
        data = [(lay.keys.unsqueeze(0), lay.values.unsqueeze(0)) for lay in layers]
        if native is not None:
            for (k, v), layer in zip(data, evict[: len(data)], strict=True):  # [1, Hkv, T, D]
                native.layers[layer].keys, native.layers[layer].values = k, v
            cache = native
        else:
            cache = new_cache(model, data, kv_cache_dtype)
        positions = torch.arange(start, start + tokens.numel()).unsqueeze(0)
        with _capturing_queries() as queries:
            out = model(input_ids=tokens.reshape(1, -1), position_ids=positions,
                        past_key_values=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
        captured.update({i: queries[layer] for i, layer in enumerate(evict)})
        new_pos = torch.arange(start, start + tokens.numel())
        for i, layer_index in enumerate(evict):
            layer = out.past_key_values.layers[layer_index]
            k, v = layer.keys[0], layer.values[0]  # [Hkv, T + n, D]
            if i < len(layers):
                lay = layers[i]
                heads = k.shape[0]
                lay.positions = torch.cat([lay.positions, new_pos.expand(heads, -1)], dim=1)
                lay.keys, lay.values = k, v
            else:
                layers.append(_Layer(k, v, new_pos.expand(k.shape[0], -1).clone()))
        return out.logits[0, -1].float()

    def evict_or_score(logical_len: int, prefill: bool, q_count: int) -> None:
        """One step's scoring and, if the block rule allows, eviction (every layer)."""
        nonlocal dead, past_point, kept
        order, past_point = block_rule(options, logical_len, prefill, past_point, point, dead,
                                       block_size)  # fmt: skip
        prompt_end = prefill and logical_len >= length
        new_kept = {}
        for i, lay in enumerate(layers):
            q_new = captured[i][-q_count:]  # [n, Hq, D] this step's queries
            if prefill and window:
                prev = lay.queries
                lay.queries = q_new if prev is None else torch.cat([prev, q_new])[-window:]
            every_query = prefill and window is None and pipeline.scored
            if not (order is not None or every_query or (not prefill and options.decode)
                    or (options.decode and prompt_end)):  # fmt: skip
                continue
            k_tok, v_tok = lay.keys.transpose(0, 1), lay.values.transpose(0, 1)  # [N, Hkv, D]
            num_resident = k_tok.shape[0]
            k_pos = dead * block_size + torch.arange(num_resident)
            if lay.running is None and (options.decode or window is None or not prefill):
                lay.running = RunningScores(k_tok.shape[1], mode=mode)
            if not pipeline.scored:
                scores = k_tok.new_zeros((k_tok.shape[1], num_resident))
            elif prefill and window:
                q = lay.queries
                q_pos = torch.arange(logical_len - q.shape[0], logical_len)
                scores = pipeline.prefill_scores(scorer, q, k_tok, v_tok, geom, q_pos, k_pos)
                if lay.running is not None and prompt_end:
                    lay.running.reset()
                    lay.running.add(scores)
            else:
                if not prefill and mode == "last":
                    q_new = q_new[-1:]  # the newest query only
                q_pos = torch.arange(logical_len - q_new.shape[0], logical_len)
                if prefill:
                    step = pipeline.prefill_scores(scorer, q_new, k_tok, v_tok, geom, q_pos,
                                                   k_pos)  # fmt: skip
                else:
                    step = scorer(q_new, k_tok, v_tok, geom, q_pos, k_pos)
                lay.running.add(step)
                scores = lay.running.scores
            if order is None:
                continue
            keep = pipeline.select(
                scores, keep=order.kept, recent=options.recent, sinks=options.sinks
            )  # [Hkv, K]
            index = keep.unsqueeze(-1).expand(-1, -1, lay.keys.shape[-1])
            lay.keys = torch.gather(lay.keys, 1, index)
            lay.values = torch.gather(lay.values, 1, index)
            lay.positions = torch.gather(lay.positions, 1, keep)
            if lay.running is not None and lay.running.length:
                lay.running.gather(keep)
            if logical_len >= point:
                lay.queries = None
            new_kept[evict[i]] = lay.positions.clone()  # by model layer, as compress_and_generate
        if order is not None:
            dead = order.dead_after
            orders.append((logical_len, prefill))
            history.append(new_kept)
            kept = new_kept

    at = begin
    logits = None
    for end in ends:
        if end <= at:
            continue
        logits = forward(ids[at:end], at)
        evict_or_score(end, prefill=end <= length, q_count=end - at)
        at = end
    tokens: list[int] = []
    rows: list[Tensor] = []
    stop = set(eos_token_ids)
    position = total
    for step in range(max_new_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        rows.append(logits)
        if token in stop or step == max_new_tokens - 1:
            break
        logits = forward(torch.tensor([token]), position)
        position += 1
        evict_or_score(position, prefill=False, q_count=1)
    return Evicting(kept=kept, orders=orders, history=history, token_ids=tokens,
                    logits=torch.stack(rows), layers=layers, dead=dead,
                    length=position)  # fmt: skip
