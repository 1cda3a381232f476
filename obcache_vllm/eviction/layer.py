"""Per-layer eviction over a paged cache view: the vLLM-free half of the attention path.

The worker's attention layers call :func:`evict_after_attention` right after a layer's
attention of one step, with the step's :class:`~obcache_vllm.eviction.step.StepPlan` and a
:class:`KvCacheView` of that layer's cache (each attention backend supplies its own view; see
:mod:`obcache_vllm.vllm_ext.worker.attention` for the data flow of a whole step). Per budgeted
row it remembers or buffers queries, scores the resident tokens, selects the kept ones and
moves them (gather, then scatter by block id). It never looks at pipeline names: it asks the
pipeline object (``window``, ``running_mode``, ``scored``).

Fault containment (see :class:`~obcache_vllm.eviction.step.RowOutcome`): an exception while
one row is scored or compacted in one layer is caught here, recorded on the row, and the row is
skipped by the remaining layers. The runner then decides: nothing written -> the request goes
on uncompressed; every layer written -> committed; some layers written -> the cache is torn,
and the scheduler finishes that request alone with an error.

Glossary: ``n`` queries of a request in this step, ``N`` resident tokens, ``K`` kept per head,
``Hq``/``Hkv`` heads, ``D`` head dim, ``bs`` block size.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from obcache_vllm.eviction.heads import body_shape, head_block_slots, head_residents
from obcache_vllm.eviction.step import RowPlan, StepPlan
from obcache_vllm.scoring import HeadGeometry, RunningScores, estimate

logger = logging.getLogger(__name__)


class KvCacheView(Protocol):
    """One attention layer's paged KV cache, in one backend's layout (adapter part (a)).

    Batched over requests: ``blocks`` is an int tensor [R, >= nb] of block rows (slot j of row
    r lives in block ``blocks[r, j // bs]``); every row moves the same number of tokens.
    """

    block_size: int
    # Whether this layer's attention reads per-head tables (the backend has per-head memory and
    # the layer nothing that rules it out: ALiBi, attention sinks); only then is
    # ``scatter_head_blocks`` called.
    per_head_reads: bool

    def gather(self, blocks: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [R, Hkv, N, D] of slots ``[0, N)`` of each block row."""
        ...

    def scatter(self, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [R, Hkv, K, D] into slots ``[0, K)`` of each block row.

        Whole blocks are written: slots ``[K, cdiv(K, bs)*bs)`` of the last block get padding
        (they lie past the request's length, and the request writes them itself later)."""
        ...

    def values_of(self, keys: torch.Tensor, values: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The values gathered ``keys``/``values`` stand for, in ``dtype`` (what scoring reads).

        ``gather`` returns what the cache stores (a quantized cache's bytes, see
        :mod:`obcache_vllm.eviction.quantized`) and ``scatter`` takes it back unchanged, so
        compaction moves stored bytes and never re-quantizes; only scores need the values."""
        ...

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src`` [n] into blocks ``dst`` [n] (block ids)."""
        ...

    def scatter_head_blocks(self, ids: torch.Tensor, keys: torch.Tensor,
                            values: torch.Tensor) -> None:  # fmt: skip
        """Write keys/values [n, bs, D] into head-blocks ``ids`` [n] (``block * Hkv + head``:
        one KV head's part of one block, see :mod:`obcache_vllm.eviction.heads`). Only a view
        whose ``per_head_reads`` is True is asked to (its backend reads per head)."""
        ...


def evict_after_attention(
    plan: StepPlan, layer: str, query: torch.Tensor, view: KvCacheView, geom: HeadGeometry
) -> None:
    """This layer's eviction work for every budgeted row of the step; faults stay in their row."""
    start = time.perf_counter()
    if plan.decode_write is not None:  # every summed-score decode query of the step, one op
        slots, positions, tokens = plan.decode_write
        plan.decode_store.write(layer, slots, positions, query.index_select(0, tokens))
    for group in plan.groups:
        rows = [r for r in group.rows if r.state.disabled is None and r.outcome.failure is None]
        if not rows:
            continue
        try:
            _group_after_attention(plan, group, rows, layer, query, view, geom)
        except Exception as exc:  # a batched op failed: a fault of every request in it
            writing = any(r.outcome.writing for r in rows)
            for r in rows:
                r.outcome.fail("compact" if writing else "score", exc, f"{layer} (batched)")
    for row in plan.rows:
        if not row.active or row.grouped:
            continue
        # Tensor parallelism, one ranking per layer: every rank enters this row's all-reduce
        # once per layer, also when it gave the row up (see StepPlan.ranking_reduction).
        reduction = plan.ranking_reduction(row)
        if row.state.disabled is None and row.outcome.failure is None:
            try:
                _row_after_attention(plan, row, layer, query, view, geom, reduction)
            except Exception as exc:  # contained: see the module docstring
                row.outcome.fail("compact" if row.outcome.writing else "score", exc, layer)
        if reduction is not None:
            reduction.join(row.num_resident, query.device)
    plan.timings.append(time.perf_counter() - start)


def _row_after_attention(plan, row: RowPlan, layer: str, query, view, geom, reduction) -> None:
    """Bookkeeping and, if ordered, compaction of one budgeted request in one layer.

    Only rows with work in this step get here (``row.active``, decided once per step by the
    runner): prefill chunks remember the last window queries, or are scored when the pipeline
    counts every prompt query (h2o); a decode row is scored only when its stored queries must be
    folded in (buffer full, or an order) or at an order. Scoring needs the resident K/V. Scoring
    a buffer of decode queries at once equals the sum of their per-step scores: no eviction
    happened in between, so each query saw exactly the resident tokens at or before its
    position (the causal mask of the scorer).
    """
    state, order, opts, pipeline = row.state, row.order, row.state.options, row.state.pipeline
    q_rows = query[row.q_start : row.q_end]  # [n, Hq, D]
    every_prompt_query = pipeline.window is None  # h2o: all prompt queries count
    prefill_end = row.prefill and row.logical_len >= row.prompt_len
    if row.prefill and not every_prompt_query and pipeline.window:
        state.remember_queries(layer, q_rows, pipeline.window)
    if state.head_layout is not None:  # its heads own their memory since an earlier order
        _heads_after_attention(plan, row, layer, q_rows, query, view, geom)
        return
    prompt_scoring = row.prefill and every_prompt_query and pipeline.scored
    if not (order is not None or prompt_scoring or row.score_decode
            or (opts.decode and prefill_end and not state.pressure_pending)):  # fmt: skip
        return

    # Every row of the step reads the same block table: the one the attention just used.
    blocks = plan.read_block_table[row.row : row.row + 1]  # [1, M]
    keys, values = view.gather(blocks, row.num_resident)
    keys, values = keys[0], values[0]  # [Hkv, N, D] each, as stored (moved, never re-stored)
    k_read, v_read = view.values_of(keys, values, query.dtype)  # what scoring reads
    if order is not None and order.max_error is not None:
        _defer(plan, row, layer, q_rows, k_read, v_read, view, blocks, geom)
        return
    scores = _scores(plan, row, layer, q_rows, k_read, v_read, geom, prefill_end)
    if order is None:
        return

    if pipeline.heads_own_memory:
        _compact_heads(plan, row, layer, view, blocks, keys, values, scores)
        return
    keep = pipeline.select(
        scores, keep=order.kept, recent=opts.recent, sinks=opts.sinks, reduce=reduction
    )
    _compact(row, layer, view, blocks, keys, values, keep, order.dead_after)


def _compact_heads(plan, row: RowPlan, layer: str, view, blocks, keys, values, scores) -> None:
    """A pipeline whose heads own their memory, at its first order: each KV head keeps its own
    count, in whole head-blocks of the order's body (the layout of
    :mod:`obcache_vllm.eviction.heads`); the tail block stays as it is. ``keys``/``values``
    [Hkv, N, D] are the resident tokens, the same ones in every head (one table so far)."""
    state, order, opts = row.state, row.order, row.state.options
    bs = row.block_size
    tail, body_blocks = body_shape(order.logical_len, order.dead_after, bs)
    kept = state.pipeline.select_heads(scores, tail=tail, body_blocks=body_blocks, block_size=bs,
                                       recent=opts.recent, sinks=opts.sinks)  # fmt: skip
    _write_heads(plan, row, layer, view, blocks, keys, values, kept, tail, body_blocks)
    if state.record is not None:
        first = state.dead * bs
        state.record[layer] = kept
        state.record[layer + ":positions"] = [first + index.cpu() for index in kept]
    state.queries.pop(layer, None)


def _heads_after_attention(plan, row: RowPlan, layer: str, q_rows, query, view, geom) -> None:
    """A request whose heads own their memory, after its first order (``state.head_layout``):
    decode-time scoring and orders over each KV head's own entries (``kv_decode``).

    Each head's entries (:func:`~obcache_vllm.eviction.heads.head_residents`: its head-blocks,
    then its part of the columns written since) are scored in one call, padded to the longest
    head with keys no query sees. The running scores hold head h's in their first
    ``lengths[h]`` columns and 0 past them, so a column a head grows into starts from 0. An
    order re-selects every head by AdaKV's rule over those uneven counts
    (``select_heads(..., lengths=)``) and writes the new body's head-blocks, every head's
    kept entries gathered before any is written, as at the first order.

    Causal keys: an entry compacted by an earlier order sits at the row's first resident slot
    (``dead * bs``), below every query scored since (each came after that order); the others at
    their logical slot, which is their position; padding beyond every position.
    """
    state, order, opts, pipeline = row.state, row.order, row.state.options, row.state.pipeline
    seed = opts.decode and row.prefill and row.logical_len >= row.prompt_len  # compressed
    # mid-prompt (kv_compress_at): the prompt's window seeds the decode scores at its end
    if not (order is not None or row.score_decode or row.decode_stored is not None or seed):
        return
    layout, bs, n = state.head_layout, row.block_size, row.num_resident
    counts = layout.counts[plan.layer_index[layer]].tolist()
    blocks = plan.read_block_table[row.row : row.row + 1]  # [1, M]
    keys, values = view.gather(blocks, n)  # [1, Hkv, N, D] as stored
    hkv = keys.shape[1]
    index, lengths, in_body = head_residents(counts, layout.body_blocks, n, bs)
    index = index.to(keys.device)
    k_heads = keys[0].reshape(hkv * n, -1)[index]  # [Hkv, W, D]: head h's first lengths[h]
    v_heads = values[0].reshape(hkv * n, -1)[index]
    width = index.shape[1]
    valid = (torch.arange(width) < lengths.view(-1, 1)).to(keys.device)
    if pipeline.scored:
        k_read, v_read = view.values_of(k_heads, v_heads, query.dtype)
        k_tok, v_tok = k_read.transpose(0, 1), v_read.transpose(0, 1)  # [W, Hkv, D]
        first = state.dead * bs
        local = torch.arange(width).view(1, -1) - torch.tensor(counts).view(-1, 1) * bs
        k_pos = torch.where(in_body, first, first + layout.body_blocks * bs + local)
        k_pos = k_pos.masked_fill(~valid.cpu(), _UNSEEN).to(keys.device)  # [Hkv, W]
        running = state.running.get(layer)
        if running is None:
            running = state.running[layer] = RunningScores(hkv, mode=state.decode_mode)
        if row.prefill:
            q = state.queries[layer]
            q_pos = torch.arange(row.logical_len - q.shape[0], row.logical_len,
                                 device=keys.device)  # fmt: skip
            step = pipeline.head_scores(state.scorer, q, k_tok, v_tok, geom, q_pos, k_pos,
                                        lengths)  # fmt: skip
            running.reset()
        else:
            q = _decode_queries(plan, row, layer, q_rows)
            q_pos = torch.arange(row.logical_len - q.shape[0], row.logical_len,
                                 device=keys.device)  # fmt: skip
            step = state.scorer(q, k_tok, v_tok, geom, q_pos, k_pos)
        running.add(step.masked_fill(~valid, 0.0))
        scores = running.scores
    else:
        scores = torch.zeros((hkv, width), dtype=torch.float32, device=keys.device)
    if order is None:
        return
    tail, body_blocks = body_shape(order.logical_len, order.dead_after, bs)
    kept = pipeline.select_heads(scores, tail=tail, body_blocks=body_blocks, block_size=bs,
                                 recent=opts.recent, sinks=opts.sinks, lengths=lengths)  # fmt: skip
    _write_heads(plan, row, layer, view, blocks, k_heads, v_heads, kept, tail, body_blocks)
    if row.logical_len >= opts.compress_point(row.prompt_len):
        state.queries.pop(layer, None)  # a session turn's window: read at its order only
    if state.record is not None:
        key = layer + ":positions"
        state.record[layer] = kept
        prev = state.record.get(key)
        if prev is not None:  # head h: its body's positions, then the slots written since
            since = torch.arange((state.dead + layout.body_blocks) * bs, row.logical_len)
            state.record[key] = [torch.cat([prev[h][: c * bs], since])[kept[h].cpu()]
                                 for h, c in enumerate(counts)]  # fmt: skip


# A causal key position no query reaches (the padding of heads shorter than the longest).
_UNSEEN = 1 << 62


def _write_heads(plan, row: RowPlan, layer: str, view, blocks, keys, values, kept,
                 tail: int, body_blocks: int) -> None:  # fmt: skip
    """Write an order's per-head selection: head h's kept entries ``kept[h]`` (sorted indices
    into ``keys``/``values`` [Hkv, W, D], its last ``tail`` the tail block's, which stays) into
    its head-blocks of the order's body, head after head; then carry the running scores over
    to the new layout (head h's first ``len(kept[h])`` columns)."""
    state, order = row.state, row.order
    if not view.per_head_reads:  # before anything is written: contained
        raise NotImplementedError("this layer's attention cannot read per head (a backend "
                                  "without per-head memory, ALiBi or attention sinks)")  # fmt: skip
    bs = row.block_size
    counts = [(len(index) - tail) // bs for index in kept]
    body = [index[: len(index) - tail].to(keys.device) for index in kept]
    kept_k = torch.cat([keys[h, index] for h, index in enumerate(body)])  # [B*Hkv*bs, D]
    kept_v = torch.cat([values[h, index] for h, index in enumerate(body)])
    kept_k, kept_v = kept_k.view(-1, bs, kept_k.shape[-1]), kept_v.view(-1, bs, kept_v.shape[-1])
    ids = head_block_slots(counts, body_blocks, order.dead_after - order.dead_before, blocks[0])
    row.outcome.writing = True
    _preserve(row, view, blocks)
    if body_blocks:
        view.scatter_head_blocks(ids, kept_k, kept_v)
    row.outcome.writing = False
    row.outcome.compacted_layers += 1
    row.outcome.head_blocks[plan.layer_index[layer]] = (counts, body_blocks)
    running = state.running.get(layer)
    if running is not None and running.length:
        scores = running.scores
        fresh = scores.new_zeros((len(kept), max(len(index) for index in kept)))
        for h, index in enumerate(kept):
            fresh[h, : len(index)] = scores[h, index.to(scores.device)]
        running.reset()
        running.add(fresh)


def _compact(row: RowPlan, layer: str, view, blocks, keys, values, keep, dead_after: int) -> None:
    """Write one layer's kept tokens ``keep`` [Hkv, K] of the resident ``keys``/``values``
    [Hkv, N, D] to the logical slots ``[dead_after*bs, L)`` of the row's ``blocks`` [1, M]
    (the block table the attention read), after copying the blocks ``order.preserve`` names."""
    state, order, opts = row.state, row.order, row.state.options
    if state.record is not None:
        state.record_keep(layer, keep, row.block_size)
    index = keep.unsqueeze(-1).expand(-1, -1, keys.shape[-1])  # [Hkv, K, D]
    kept_k = torch.gather(keys, 1, index)  # gathered before anything is written
    kept_v = torch.gather(values, 1, index)
    row.outcome.writing = True
    _preserve(row, view, blocks)
    # Kept tokens go to logical slots [dead_after*bs, L): block (dead_after - dead_before) on
    # of the row as the attention read it.
    view.scatter(blocks[:, dead_after - order.dead_before :], kept_k[None], kept_v[None])
    row.outcome.writing = False
    row.outcome.compacted_layers += 1
    running = state.running.get(layer)
    if running is not None and running.length:  # empty: a window pipeline before prompt end
        running.gather(keep)
    if row.logical_len >= opts.compress_point(row.prompt_len):
        state.queries.pop(layer, None)  # kv_prefill_evict keeps them for the next chunk's order


def _preserve(row: RowPlan, view, blocks) -> None:
    """Copy the stock KV the order is about to overwrite into its spare blocks (the scheduler
    registers them in the prefix cache after the step, so this runs in every layer whether
    or not anything is then written)."""
    order = row.order
    if order.preserve:
        first = order.dead_before
        src = blocks[0, [index - first for index, _ in order.preserve]]
        dst = torch.tensor([b for _, b in order.preserve], dtype=src.dtype, device=src.device)
        view.copy_blocks(src, dst)


class DeferredLayer:
    """One layer's part of an error target's order, until every layer has scored: its cache
    view and block row, what its selection ranks by, and its estimate of each candidate."""

    __slots__ = ("view", "blocks", "ranking", "curve")

    def __init__(self, view, blocks, ranking, curve) -> None:
        self.view, self.blocks, self.ranking, self.curve = view, blocks, ranking, curve


def _candidates(row: RowPlan) -> list[int]:
    """An error target's candidate dead-block counts, from the most blocks freed (the floor
    budget's ``dead_after``) to none (``dead_before``): whole blocks only, as every order."""
    return list(range(row.order.dead_after, row.order.dead_before - 1, -1))


def _defer(plan, row: RowPlan, layer: str, q_rows, keys, values, view, blocks, geom) -> None:
    """Score one layer for an error target and keep what the choice needs (nothing written).

    Window pipelines score with the prompt's last queries, as at any compress point; the
    error of each count is the change of those queries' outputs when the rest is evicted
    (``estimate.window_error_curve``). A pipeline of every prompt query (h2o, with a score that
    is a share of attention) loses the share of its summed scores it evicts.
    """
    state, pipeline, opts = row.state, row.state.pipeline, row.state.options
    kept = torch.tensor([row.logical_len - d * row.block_size for d in _candidates(row)])
    shape = {"recent": opts.recent, "sinks": opts.sinks, "per_head": opts.per_head}
    if pipeline.window is None:
        ranking = _scores(plan, row, layer, q_rows, keys, values, geom, True)
        curve = estimate.share_curve(ranking, kept, **shape)
    else:
        device = keys.device
        k_tok, v_tok = keys.transpose(0, 1), values.transpose(0, 1)  # [N, Hkv, D]
        k_pos = state.dead * row.block_size + torch.arange(row.num_resident, device=device)
        q = state.queries[layer]
        q_pos = torch.arange(row.logical_len - q.shape[0], row.logical_len, device=device)
        ranking = pipeline.prefill_scores(state.scorer, q, k_tok, v_tok, geom, q_pos, k_pos)
        if opts.decode and row.logical_len >= row.prompt_len:  # they seed the decode scores
            running = state.running.get(layer)
            if running is None:
                running = state.running[layer] = RunningScores(keys.shape[0],
                                                               mode=state.decode_mode)  # fmt: skip
            running.reset()
            running.add(ranking)
        curve = estimate.window_error_curve(q, k_tok, v_tok, geom, ranking, kept, q_pos=q_pos,
                                            k_pos=k_pos, **shape)  # fmt: skip
    row.outcome.deferred[layer] = DeferredLayer(view, blocks, ranking, curve.cpu())


def finish_deferred(plan: StepPlan, num_layers: int, calibrations=()) -> None:
    """Choose and write every error target's order of the step, after the forward pass.

    All layers share one block table, so the count is chosen only once every layer has scored
    (:func:`_defer` in each); nothing has been written or freed by then. The choice is the
    fewest kept tokens whose estimate (the mean of the layers' curves) is at most the target
    (:func:`obcache_vllm.scoring.estimate.choose`), or for a KL target (``kl_target``) the
    KL that the calibration measured with the row's selection (one of ``calibrations``,
    :class:`~obcache_vllm.scoring.calibration.KlCalibration`, the served model's) predicts from
    every layer's curve; then each layer gathers its resident K/V
    again, selects that many and writes them, as an ordinary order would. Faults are contained
    to the row as in the layers (a fault before the first write leaves the cache as it was).
    """
    start = time.perf_counter()
    for row in plan.rows:
        outcome = row.outcome
        if not outcome.deferred or outcome.failure is not None:
            continue
        opts, order = row.state.options, row.order
        try:
            if len(outcome.deferred) != num_layers:
                raise RuntimeError(f"{len(outcome.deferred)} of {num_layers} layers scored")
            curves = torch.stack([d.curve for d in outcome.deferred.values()])  # [L, C]
            if opts.kl_target:
                calibration = next((c for c in calibrations if c.mismatch(opts) is None), None)
                if calibration is None:
                    raise RuntimeError("a KL target without the model's KL calibration of its "
                                       "selection")  # fmt: skip
                curve = calibration.nats(curves)
            else:
                curve = curves.mean(dim=0)
            index = estimate.choose(curve, order.max_error)
        except Exception as exc:
            outcome.fail("score", exc, "error target")
            continue
        dead_after = _candidates(row)[index]
        kept = row.logical_len - dead_after * row.block_size
        outcome.chosen = (dead_after, kept, float(curve[index]))
        for layer, deferred in outcome.deferred.items():
            try:
                if dead_after == order.dead_before:  # nothing goes: only the spare copies
                    _preserve(row, deferred.view, deferred.blocks)
                    outcome.compacted_layers += 1
                    row.state.queries.pop(layer, None)
                    continue
                keys, values = deferred.view.gather(deferred.blocks, row.num_resident)
                keep = row.state.pipeline.select(deferred.ranking, keep=kept, recent=opts.recent,
                                                 sinks=opts.sinks)  # fmt: skip
                _compact(row, layer, deferred.view, deferred.blocks, keys[0], values[0], keep,
                         dead_after)  # fmt: skip
            except Exception as exc:  # contained: see the module docstring
                outcome.fail("compact" if outcome.writing else "score", exc, layer)
                break
        outcome.deferred = {}
    plan.timings.append(time.perf_counter() - start)


def _group_after_attention(plan, group, rows, layer, query, view, geom) -> None:
    """Decode scoring and evictions of several requests with the same shapes, batched.

    The runner groups decode-time orders (or, without an order, stored decode queries to fold
    into the running scores) with the same options, resident count ``N``, query
    count ``W`` and kept count ``K`` (:class:`~obcache_vllm.eviction.step.RowGroup`). Their K/V
    are gathered in one op, scored as ONE request whose heads are the requests' heads side by
    side (scores are per KV head, a query head only meets its own KV head, so stacking
    requests along the head axis changes nothing), selected together, gathered and scattered
    in one op each. Positions are relative: each request's keys are its last N tokens and its
    queries the last W, so ``k_pos = 0..N-1``, ``q_pos = N-W..N-1`` give every request its own
    causal mask. Per-request work is left to the running scores (a few small ops).
    """
    first = rows[0]
    state, opts, pipeline = first.state, first.state.options, first.state.pipeline
    num_rows, n, w = len(rows), first.num_resident, group.num_queries
    index = torch.tensor([r.row for r in rows], device=plan.read_block_table.device)
    blocks = plan.read_block_table.index_select(0, index)  # [R, M]
    keys, values = view.gather(blocks, n)  # [R, Hkv, N, D] as stored
    hkv, d = keys.shape[1], keys.shape[3]
    if pipeline.scored:
        k_read, v_read = view.values_of(keys, values, query.dtype)
        if first.decode_position is not None:  # summed: the stored decode queries
            slots = torch.tensor([r.state.decode_slot for r in rows], device=keys.device)
            q = plan.decode_store.read_many(layer, slots, w)  # [R, W, Hq, D]
        else:  # the newest query of each
            tokens = torch.tensor([r.q_start for r in rows], device=query.device)
            q = query.index_select(0, tokens)[:, None]  # [R, 1, Hq, D]
        hq = q.shape[2]
        big = HeadGeometry(num_rows * hq, num_rows * hkv, geom.head_dim, geom.scale)
        step = state.scorer(
            q.permute(1, 0, 2, 3).reshape(w, num_rows * hq, d),  # [W, R*Hq, D]
            k_read.permute(2, 0, 1, 3).reshape(n, num_rows * hkv, d),  # [N, R*Hkv, D]
            v_read.permute(2, 0, 1, 3).reshape(n, num_rows * hkv, d),
            big,
            torch.arange(n - w, n, device=keys.device),
            torch.arange(n, device=keys.device),
        ).view(num_rows, hkv, n)  # [R, Hkv, N]
        scores = []
        for i, r in enumerate(rows):
            running = r.state.running.get(layer)
            if running is None:
                running = r.state.running[layer] = RunningScores(hkv, mode=r.state.decode_mode)
            running.add(step[i])
            scores.append(running.scores)
        if first.order is None:  # only folding stored decode queries into the running scores
            return
        scores = torch.stack(scores)  # [R, Hkv, N]
    elif first.order is None:
        return
    else:
        scores = torch.zeros((num_rows, hkv, n), dtype=torch.float32, device=keys.device)
    keep = pipeline.select_batch(scores, keep=first.order.kept, recent=opts.recent,
                                 sinks=opts.sinks)  # fmt: skip
    index_kd = keep.unsqueeze(-1).expand(-1, -1, -1, d)  # [R, Hkv, K, D]
    kept_k = torch.gather(keys, 2, index_kd)  # gathered before anything is written
    kept_v = torch.gather(values, 2, index_kd)
    for r in rows:
        r.outcome.writing = True
    view.scatter(blocks[:, group.shift :], kept_k, kept_v)
    for i, r in enumerate(rows):
        r.outcome.writing = False
        r.outcome.compacted_layers += 1
        running = r.state.running.get(layer)
        if running is not None:
            running.gather(keep[i])
        if r.state.record is not None:
            r.state.record_keep(layer, keep[i], r.block_size)


def _scores(plan: StepPlan, row: RowPlan, layer, q_rows, keys, values, geom, prefill_end):
    """Current scores [Hkv, N] of the resident tokens (updates the running scores)."""
    state, opts, pipeline = row.state, row.state.options, row.state.pipeline
    num_heads, num_resident = keys.shape[0], keys.shape[1]
    if not pipeline.scored:
        return keys.new_zeros((num_heads, num_resident), dtype=torch.float32)
    device = keys.device
    k_tok, v_tok = keys.transpose(0, 1), values.transpose(0, 1)  # [N, Hkv, D] views
    # Logical slot of resident j is dead*bs + j: the true position for tokens written since
    # the last compaction, and below every later query for compacted ones (kept tokens only
    # move right, to slots < the length at compaction). So it is an exact causal key.
    k_pos = state.dead * row.block_size + torch.arange(num_resident, device=device)
    every_prompt_query = pipeline.window is None
    running = state.running.get(layer)
    if running is None and (opts.decode or every_prompt_query or not row.prefill):
        running = state.running[layer] = RunningScores(num_heads, mode=state.decode_mode)

    if row.order is not None and row.order.pressure and pipeline.window:
        return _pressure_scores(row, layer, q_rows, k_tok, v_tok, geom, k_pos, running)
    if row.prefill and not every_prompt_query:  # window pipelines: score once, at the end
        q = state.queries[layer]
        q_pos = torch.arange(row.logical_len - q.shape[0], row.logical_len, device=device)
        if state.record is not None:
            first = row.logical_len - q.shape[0]
            state.record[layer + ":window"] = (q.shape[0], first, row.logical_len - 1)
        scores = pipeline.prefill_scores(state.scorer, q, k_tok, v_tok, geom, q_pos, k_pos)
        if running is not None and prefill_end:
            running.reset()
            running.add(scores)
        return scores
    if row.prefill:  # every prompt query: this chunk's contribution, added up
        q_pos = torch.arange(row.logical_len - q_rows.shape[0], row.logical_len, device=device)
        step = pipeline.prefill_scores(state.scorer, q_rows, k_tok, v_tok, geom, q_pos, k_pos)
    else:
        q = _decode_queries(plan, row, layer, q_rows)
        q_pos = torch.arange(row.logical_len - q.shape[0], row.logical_len, device=device)
        step = state.scorer(q, k_tok, v_tok, geom, q_pos, k_pos)
    running.add(step)
    return running.scores


def _decode_queries(plan: StepPlan, row: RowPlan, layer: str, q_rows):
    """The decode-time queries a row scores now [n, Hq, D]: the newest only ("last"), or every
    one stored since the last scoring ("sum"; in a row of several, the stored ones then it)."""
    state = row.state
    if row.decode_position is not None:
        return plan.decode_store.read(layer, state.decode_slot, row.decode_position + 1)
    if row.decode_stored is not None:
        if not row.decode_stored:
            return q_rows
        stored = plan.decode_store.read(layer, state.decode_slot, row.decode_stored)
        return torch.cat([stored, q_rows])
    return q_rows[-1:]


def _pressure_scores(row: RowPlan, layer, q_rows, k_tok, v_tok, geom, k_pos, running):
    """Scores of an order given because the pool is short (window pipelines): the last
    ``window`` queries the request has, its remembered prompt window then this step's decode
    queries; with ``kv_decode`` they seed the running scores, as at a prompt's end."""
    state, pipeline = row.state, row.state.pipeline
    device = k_tok.device
    remembered = state.queries.get(layer)
    if row.prefill:  # this chunk is in the remembered window already
        q = remembered if remembered is not None else q_rows
        q_pos = torch.arange(row.logical_len - q.shape[0], row.logical_len, device=device)
    else:
        q, q_pos = q_rows, torch.arange(row.logical_len - q_rows.shape[0], row.logical_len,
                                         device=device)  # fmt: skip
        if remembered is not None:  # the prompt's last queries, before this step's
            end = min(row.prompt_len, row.logical_len - q_rows.shape[0])
            past = torch.arange(end - remembered.shape[0], end, device=device)
            q, q_pos = torch.cat([remembered, q]), torch.cat([past, q_pos])
        q, q_pos = q[-pipeline.window :], q_pos[-pipeline.window :]
    scores = pipeline.prefill_scores(state.scorer, q, k_tok, v_tok, geom, q_pos, k_pos)
    if running is not None and state.options.decode:
        running.reset()
        running.add(scores)
    return scores

