"""An engine configuration as admission reads it, without an engine (SimpleNamespace objects).

:func:`engine_config` is a CPU engine that serves every budget; dotted keyword overrides set
one attribute each (``**{"cache_config.block_size": 24}``).
"""

from __future__ import annotations

from types import SimpleNamespace


def set_attributes(obj, over: dict):
    """Set each dotted attribute path of ``over`` on ``obj``; returns ``obj``."""
    for path, value in over.items():
        *parents, leaf = path.split(".")
        target = obj
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)
    return obj


def engine_config(**over):
    """A CPU engine configuration that serves every budget, with ``over`` applied."""
    from vllm.v1.core.sched.scheduler import Scheduler

    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16, num_gpu_blocks=None,
                                     enable_prefix_caching=True, kv_sharing_fast_prefill=False),
        attention_config=SimpleNamespace(backend=SimpleNamespace(name="FLASH_ATTN"),
                                         backend_per_kind={}),
        compilation_config=SimpleNamespace(cudagraph_mode=None),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1,
                                        decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1, enable_dbo=False),
        model_config=SimpleNamespace(max_model_len=4096, is_hybrid=False,
                                     is_attention_free=False, use_mla=False,
                                     is_mm_prefix_lm=False, rswa_window=None,
                                     get_sliding_window=lambda: None,
                                     hf_text_config=SimpleNamespace(),
                                     # the default model's name and depth (its KL calibration)
                                     model="/models/SmolLM2-135M-Instruct",
                                     get_num_layers=lambda parallel_config: 30),
        scheduler_config=SimpleNamespace(async_scheduling=False, scheduler_cls=None,
                                         disable_hybrid_kv_cache_manager=False,
                                         max_num_batched_tokens=256,
                                         get_scheduler_cls=lambda: Scheduler),
        kv_transfer_config=None, use_v2_model_runner=False, speculative_config=None,
    )  # fmt: skip
    return set_attributes(cfg, over)
