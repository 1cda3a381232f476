"""FlashAttention adapter (vLLM's ``FLASH_ATTN`` on CUDA): view, in-place shift, refusals, classes.

Installed on CUDA by the seam registry's ``cuda`` rows (:data:`obcache_vllm.vllm_ext.seams.
REGISTRY`, applied by :func:`obcache_vllm.vllm_ext.install.install`, which also checks them):
``AttentionBackendEnum.FLASH_ATTN`` is overridden with :class:`OBCacheFlashAttnBackend` (same
name: the rest of vLLM sees FLASH_ATTN) and ``gpu_worker.Worker._make_model_runner`` is wrapped
(:func:`_wrap_make_model_runner`) so the V1 path builds :class:`OBCacheGPUModelRunner`. NOT
run by the project on a GPU yet: the pure-torch parts are tested on CPU tensors
(tests/unit/test_flash_attn_layout.py) and by ``scripts/gpu_kernels_check.sh``;
``scripts/gpu_check.sh`` runs the engine checks on a GPU.

(a) Layout (vLLM 0.32; older vLLM had ``[2, num_blocks, bs, Hkv, D]``): a layer's cache is
    the logical view ``[num_blocks, Hkv, bs, 2*D]`` (K then V in the last dim) in any of the
    KVCacheLayout stride orders; see :mod:`.flash_attn_layout`.
(b) Reads: the block table and ``seq_lens`` the builder gets are slices of the runner's
    persistent buffers; :meth:`FlashAttnAdapter.shift_reads` shifts them IN PLACE (the dead
    counts reach the device from a pinned buffer, without blocking), and replaces the host-side
    ``max_seq_len`` / ``seq_lens_cpu_upper_bound`` by the shifted ones (FA's ``max_seqlen_k``
    and FA3's ahead-of-time scheduler read them). Nothing else reads those buffers after the
    build in the same step: the slot mapping was computed from the logical table before, and
    the next step's ``commit_block_table`` / ``_prepare_inputs`` rewrite them.
(c) Refusals (declared in :data:`obcache_vllm.admission.CAPABILITIES`, refused by
    :func:`obcache_vllm.admission.platform_refusal`), each a real hazard:

    * full CUDA graphs (``cudagraph_mode`` FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE, the
      default): a full graph replays the attention kernels without running Python, so a
      layer's scoring, query buffers and compaction would silently not happen on the steps it
      captures. PIECEWISE (attention runs eagerly between captured pieces) and NONE
      (``--enforce-eager``) are safe; the shift itself would be graph-safe (in place).
    * an attention backend chosen by the platform rather than ``--attention-backend
      FLASH_ATTN``: the choice is made in the worker, after the front-end accepted the request.
    * a block size that is not a multiple of 16: the FA kernel would get kernel blocks
      smaller than the manager's (``_with_kernel_block_table``), and the shift counts whole
      manager blocks. (The builder also refuses it at run time, see
      :class:`OBCacheFlashAttnMetadataBuilder`.)
    * decode/prefill context parallelism, dual-batch overlap (micro-batches slice the
      metadata), KV-sharing fast prefill, ALiBi, multimodal prefix-LM and R-SWA masks (they
      read logical positions that compaction changes).

Cascade attention was removed in vLLM 0.32 (``GPUModelRunner.cascade_attn_enabled`` is a
deprecated ``False``); :class:`OBCacheGPUModelRunner` fails at start if it ever comes back
rather than carrying code that disables it.

Glossary: ``R`` rows of the step, ``bs`` block size.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from obcache_vllm.admission import CAPABILITIES
from obcache_vllm.eviction.paged import shift_rows_in_place
from obcache_vllm.eviction.step import StepPlan
from obcache_vllm.vllm_ext.worker.attention import (
    BackendAdapter,
    EvictingBuilderMixin,
    EvictingImplMixin,
)
from obcache_vllm.vllm_ext.worker.backends.flash_attn_layout import (
    DeadCounts,
    FlashAttnKvView,
)
from obcache_vllm.vllm_ext.worker.runner import EvictingRunnerMixin


class FlashAttnAdapter(BackendAdapter):
    name = CAPABILITIES["cuda"].adapter

    def __init__(self) -> None:
        self._dead: DeadCounts | None = None  # per worker process (one device)

    def kv_view(self, kv_cache, layer, impl) -> FlashAttnKvView:
        return FlashAttnKvView(kv_cache, impl.head_size)

    def shift_reads(self, common_attn_metadata, plan: StepPlan):
        cm = common_attn_metadata
        table, seq_lens = cm.block_table_tensor, cm.seq_lens  # [R, M], [R] persistent slices
        num_rows = table.shape[0]
        if not plan.reads_shifted:
            if self._dead is None or self._dead.device != table.device:
                self._dead = DeadCounts(table.device)
            dead = self._dead.stage(plan.dead, num_rows)  # [R] on the device, non-blocking
            shift_rows_in_place(table, seq_lens, dead, plan.block_size)
            plan.reads_shifted = True
        upper = cm.seq_lens_cpu_upper_bound
        if upper is None:  # keep the logical max: still an upper bound
            return cm
        dead_host = torch.zeros(num_rows, dtype=upper.dtype)
        count = min(num_rows, len(plan.dead))
        dead_host[:count] = torch.tensor(plan.dead[:count], dtype=upper.dtype)
        upper = upper[:num_rows] - dead_host * plan.block_size  # [R] host
        max_seq_len = int(upper.max()) if num_rows else 0
        return dataclasses.replace(cm, seq_lens_cpu_upper_bound=upper, max_seq_len=max_seq_len)


ADAPTER = FlashAttnAdapter()


class OBCacheFlashAttnMetadataBuilder(EvictingBuilderMixin, FlashAttentionMetadataBuilder):
    """FlashAttention's builder with shifted reads; refuses eviction (the budgeted rows go on
    uncompressed, a contained fault) when the kernel block size is not the manager's."""

    obcache_adapter = ADAPTER

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        plan = self.obcache_plan
        if plan is not None and self.kv_cache_spec.block_size != plan.block_size:
            detail = (
                f"FLASH_ATTN kernel block size {self.kv_cache_spec.block_size} differs from "
                f"the KV manager's {plan.block_size}"
            )
            for row in plan.rows:
                if row.outcome.failure is None:
                    row.outcome.failure = ("schedule", "unsupported", detail)
            assert not plan.shifts_reads, "dead blocks under an unsupported block size"
            self.obcache_plan = None  # the runner resets it after the build anyway
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


class OBCacheFlashAttnImpl(EvictingImplMixin, FlashAttentionImpl):
    obcache_adapter = ADAPTER


class OBCacheFlashAttnBackend(FlashAttentionBackend):
    """FLASH_ATTN with OBCache eviction (same name: the rest of vLLM must not notice)."""

    @staticmethod
    def get_impl_cls():
        return OBCacheFlashAttnImpl

    @staticmethod
    def get_builder_cls():
        return OBCacheFlashAttnMetadataBuilder


class OBCacheGPUModelRunner(EvictingRunnerMixin, GPUModelRunner):
    """vLLM's V1 GPU model runner with the worker half of eviction."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "cascade_attn_enabled", False):
            raise RuntimeError(
                "this vLLM enables cascade attention, which obcache-vllm's FLASH_ATTN adapter "
                "does not support (it reads a common prefix past the shifted block tables)"
            )


def _wrap_make_model_runner(original):
    @functools.wraps(original)
    def _make_model_runner(self):
        if self.use_v2_model_runner:  # budgets are refused with V2 (obcache_vllm.admission)
            return original(self)
        return OBCacheGPUModelRunner(self.vllm_config, self.device)

    _make_model_runner.__obcache_wrapped__ = True
    return _make_model_runner
