"""vLLM's start-up check of the KV pool, relaxed as far as ``kv_prefill_evict`` makes safe.

Stock vLLM refuses to start when the pool cannot hold one request of ``max_model_len``
tokens. With ``kv_prefill_evict`` a budgeted request holds at most its bounded peak, so the
pool must only hold one full prefill chunk (``max_num_batched_tokens``) plus two blocks (the
smallest bounded peak); a smaller pool is refused exactly as stock vLLM refuses it. Requests
that can never fit get a 400 at admission (:func:`obcache_vllm.admission.capacity_error`).
Runs in the EngineCore process, where the pool is sized. The two wrappers below are rows of
the seam registry (:data:`obcache_vllm.vllm_ext.seams.REGISTRY`); vLLM 0.33 moved
``_check_enough_kv_cache_memory`` to ``vllm.v1.core.kv_cache_planning``, which the registry's
versioned rows follow.
"""

from __future__ import annotations

import contextvars
import functools
import logging

logger = logging.getLogger(__name__)

# The smallest pool (tokens) the relaxed check accepts, while get_kv_cache_configs runs.
_min_pool_tokens: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "obcache_min_pool_tokens", default=None
)


def min_pool_tokens(vllm_config) -> int:
    """The smallest pool the relaxed start-up check accepts."""
    chunk = vllm_config.scheduler_config.max_num_batched_tokens
    return chunk + 2 * vllm_config.cache_config.block_size


def _one_kind_of_layer(kv_cache_specs) -> bool:
    """Whether every attention layer of every worker has the same KV-cache spec type (one
    group). A hybrid model (sliding-window and global layers) gets several groups and keeps
    stock's check: serving prompts longer than the pool there would need the capacity checks
    (``admission.capacity_error``) to count every group, which they do not; a pool below stock's
    minimum stalled the engine (``tests/engine/test_gemma3.py``)."""
    kinds = {type(spec).__name__ for specs in kv_cache_specs or () for spec in specs.values()}
    return len(kinds) <= 1


def _wrap_get_kv_cache_configs(original):
    @functools.wraps(original)
    def get_kv_cache_configs(vllm_config, *args, **kwargs):
        specs = kwargs.get("kv_cache_specs", args[0] if args else None)
        if not _one_kind_of_layer(specs):
            return original(vllm_config, *args, **kwargs)
        token = _min_pool_tokens.set(min_pool_tokens(vllm_config))
        try:
            return original(vllm_config, *args, **kwargs)
        finally:
            _min_pool_tokens.reset(token)

    get_kv_cache_configs.__obcache_wrapped__ = True
    return get_kv_cache_configs


def _wrap_check_enough(original):
    @functools.wraps(original)
    def check_enough_kv_cache_memory(
        available_memory, get_needed_memory, max_model_len, estimate_max_model_len
    ):
        try:
            return original(
                available_memory, get_needed_memory, max_model_len, estimate_max_model_len
            )
        except ValueError:
            minimum = _min_pool_tokens.get()
            if minimum is None or available_memory <= 0:
                raise
            fits = estimate_max_model_len(available_memory)
            if fits < minimum:
                raise
            logger.warning(
                "obcache: the KV pool holds about %d tokens, less than max_model_len=%d. "
                "Serving anyway: requests that cannot fit get HTTP 400, and budgeted ones "
                "with kv_prefill_evict can have prompts longer than the pool.",
                fits,
                max_model_len,
            )

    check_enough_kv_cache_memory.__obcache_wrapped__ = True
    return check_enough_kv_cache_memory
