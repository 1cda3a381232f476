"""OBCache inside vLLM's CPU attention path: shifted reads, scoring and compaction per layer.

Installed by overriding ``AttentionBackendEnum.CPU_ATTN`` (the CPU platform ignores
``--attention-backend``), keeping the backend's name so every other part of vLLM sees CPU_ATTN.

* Builder: when any request of the step has dead head blocks, the attention *reads* get a new
  block table shifted left by that count and ``seq_len - dead*bs`` (new tensors: the persistent
  block table stays logical, it drives the next step's slot mapping). Without budgeted
  requests in the batch the builder is byte-for-byte vLLM's.
* Impl: after vLLM's attention of the layer has run (so this step still attends to the full
  cache), for each budgeted request it remembers the last prompt queries (prefill chunks), feeds
  running scores (h2o, decode), and applies the step's eviction order: gather the resident K/V
  from the paged cache, score per KV head, keep ``order.kept`` tokens per head, and write them to
  the tail slots ``[dead_after*bs, L)``. Every head keeps the same count; heads may keep
  different tokens. RoPE was applied before caching, so kept keys keep their true positions.

Glossary: ``n`` queries of a request in this step, ``N`` resident tokens, ``K`` kept per head,
``Hq``/``Hkv`` heads, ``D`` head dim, ``bs`` block size.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from obcache_vllm.scoring import HeadGeometry, RunningScores
from obcache_vllm.vllm_ext.paged import probe_layout, token_offsets
from obcache_vllm.vllm_ext.step import RowPlan, StepPlan

_current = threading.local()


def set_step_plan(plan: StepPlan | None) -> None:
    """Publish the plan of the step whose attention metadata is being built (runner only)."""
    _current.plan = plan


def current_step_plan() -> StepPlan | None:
    return getattr(_current, "plan", None)


def shift_reads(cm: CommonAttentionMetadata, dead: tuple[int, ...], block_size: int):
    """A copy of ``cm`` whose block table and seq_lens skip each row's dead head blocks."""
    num_reqs = cm.block_table_tensor.shape[0]
    dead_t = torch.zeros(num_reqs, dtype=torch.int64)
    dead_t[: len(dead)] = torch.tensor(dead, dtype=torch.int64)
    table = cm.block_table_tensor  # [R, M]
    width = table.shape[1]
    cols = torch.arange(width).unsqueeze(0) + dead_t.unsqueeze(1)  # [R, M]
    shifted = torch.gather(table, 1, cols.clamp(max=width - 1))
    shifted = shifted.masked_fill(cols >= width, 0)  # null block past the end
    seq_lens = cm.seq_lens - (dead_t * block_size).to(cm.seq_lens.dtype)
    return dataclasses.replace(
        cm,
        block_table_tensor=shifted,
        seq_lens=seq_lens,
        max_seq_len=int(seq_lens.max().item()) if num_reqs else 0,
    )


class OBCacheMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder, plus the shifted reads and the step plan for the impl."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        plan = current_step_plan()
        if plan is not None and plan.shifts_reads:
            common_attn_metadata = shift_reads(common_attn_metadata, plan.dead, self.block_size)
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.obcache_plan = plan if plan is not None and plan.rows else None
        return metadata


class OBCacheCPUImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, then OBCache bookkeeping and compaction for budgeted requests."""

    _geometry: HeadGeometry | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        result = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw
        )
        plan = getattr(attn_metadata, "obcache_plan", None)
        if plan is not None and self.attn_type == AttentionType.DECODER:
            start = time.perf_counter()
            for row in plan.rows:
                self._after_attention(layer, query, kv_cache, attn_metadata, plan, row)
            plan.timings.append(time.perf_counter() - start)
        return result

    @property
    def geometry(self) -> HeadGeometry:
        if self._geometry is None:
            self._geometry = HeadGeometry(
                num_q_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size,
                scale=self.scale,
            )
        return self._geometry

    def _after_attention(self, layer, query, kv_cache, md, plan: StepPlan, row: RowPlan) -> None:
        """Bookkeeping and, if ordered, compaction of one budgeted request in this layer.

        Cheap every step: prefill chunks remember the last window queries; decode steps (with
        ``kv_decode``) append their query to a small buffer. Scoring needs the resident K/V and
        runs only when it must: at an order, at the end of the prompt when decode eviction will
        need running scores, for every h2o prompt chunk (h2o sums over all prompt queries), and
        when the decode buffer is full. Scoring a buffer of decode queries at once equals the sum
        of their per-step scores: no eviction happened in between, so each query saw exactly the
        resident tokens at or before its position (the causal mask below).
        """
        state, order, opts = row.state, row.order, row.state.options
        name = layer.layer_name
        q_rows = query[row.q_start : row.q_end]  # [n, Hq, D]
        h2o_prefill = opts.pipeline == "h2o" and row.prefill
        prefill_end = row.prefill and row.logical_len >= row.prompt_len
        if row.prefill and not h2o_prefill and opts.query_window > 0:
            state.remember_queries(name, q_rows, opts.query_window)
        decode_full = False
        # Streaming has no score: buffering its decode queries would only grow memory (the
        # buffer is drained by scoring, which streaming never does).
        if not row.prefill and opts.decode and opts.pipeline != "streaming":
            decode_full = state.buffer_decode_query(name, q_rows)
        if not (order is not None or h2o_prefill or decode_full or (opts.decode and prefill_end)):
            return

        keys, values, k_off, v_off = self._resident_kv(layer, kv_cache, md, plan, row)
        scores = self._scores(state, name, q_rows, keys, values, row, prefill_end)
        if order is None:
            return

        keep = state.pipeline.select(scores, keep=order.kept, recent=opts.recent, sinks=opts.sinks)
        if state.record is not None:
            state.record[name] = keep.clone()
        shift = (order.dead_after - order.dead_before) * plan.block_size
        index = keep.unsqueeze(-1).expand(-1, -1, self.head_size)  # [Hkv, K, D]
        # Gather everything before writing anything: destinations may overlap sources.
        kept_k = torch.gather(keys, 1, index)
        kept_v = torch.gather(values, 1, index)
        flat = kv_cache.view(-1)
        flat[k_off[:, shift:]] = kept_k
        flat[v_off[:, shift:]] = kept_v
        running = state.running.get(name)
        if running is not None:
            running.gather(keep)
        state.queries.pop(name, None)

    def _resident_kv(self, layer, kv_cache, md, plan: StepPlan, row: RowPlan):
        """Resident keys and values [Hkv, N, D] of the row, and their flat cache offsets."""
        offsets = plan.offsets.get(row.row)
        if offsets is None:  # the same for every layer of the step: compute once
            num_resident = row.logical_len - row.state.dead * plan.block_size
            layout = probe_layout(layer.isa, kv_cache.dtype, plan.block_size, self.head_size)
            offsets = plan.offsets[row.row] = token_offsets(
                layout, md.block_table[row.row], num_resident, self.num_kv_heads
            )
        k_off, v_off = offsets
        flat = kv_cache.view(-1)
        return flat[k_off], flat[v_off], k_off, v_off

    def _scores(self, state, name, q_rows, keys, values, row: RowPlan, prefill_end: bool):
        """Current scores [Hkv, N] of the resident tokens (updates the running scores)."""
        opts, num_resident = state.options, keys.shape[1]
        if opts.pipeline == "streaming":
            return torch.zeros(self.num_kv_heads, num_resident)
        k_tok, v_tok = keys.transpose(0, 1), values.transpose(0, 1)  # [N, Hkv, D] views
        # Logical slot of resident j is dead*bs + j: the true position for tokens written since
        # the last compaction, and below every later query for compacted ones (kept tokens only
        # move right, to slots < the length at compaction). So it is an exact causal key.
        k_pos = state.dead * row.block_size + torch.arange(num_resident)
        running = state.running.get(name)
        if running is None and (opts.decode or opts.pipeline == "h2o" or not row.prefill):
            running = state.pipeline.make_running(self.num_kv_heads)
            if running is None:  # snapkv: accumulate decode queries as H2O does
                running = RunningScores(self.num_kv_heads, mode="sum")
            state.running[name] = running

        if row.prefill and opts.pipeline == "h2o":
            q, scored = q_rows, None
        elif row.prefill:
            q = state.queries[name]
            scored = "window"
        else:
            q = state.decode_queries.pop(name, q_rows)
            if running.mode == "last":
                q = q[-1:]
            scored = None
        q_pos = torch.arange(row.logical_len - q.shape[0], row.logical_len)
        if scored == "window":
            if state.record is not None:
                state.record[name + ":window"] = (q.shape[0], int(q_pos[0]), int(q_pos[-1]))
            scores = state.pipeline.prefill_scores(
                state.scorer, q, k_tok, v_tok, self.geometry, q_pos=q_pos, k_pos=k_pos
            )
            if running is not None and prefill_end:
                running.reset()
                running.add(scores)
            return scores
        running.add(state.scorer(q, k_tok, v_tok, self.geometry, q_pos=q_pos, k_pos=k_pos))
        return running.scores


class OBCacheCPUBackend(CPUAttentionBackend):
    """CPU_ATTN with OBCache eviction (same name: the rest of vLLM must not notice)."""

    @staticmethod
    def get_impl_cls():
        return OBCacheCPUImpl

    @staticmethod
    def get_builder_cls():
        return OBCacheMetadataBuilder
