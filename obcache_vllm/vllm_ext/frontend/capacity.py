"""Who fits a KV pool smaller than the context, and a 400 naming the field for who does not.

Stock vLLM refuses to start when the KV pool cannot hold one request of ``max_model_len``
tokens. With ``kv_prefill_evict`` a budgeted request holds at most its bounded peak
(:func:`obcache_vllm.eviction.planning.peak_blocks`), so the plugin relaxes that start-up check
(:mod:`obcache_vllm.vllm_ext.engine.pool_check`) and refuses at admission, with a 400 naming the
field, every request whose worst case does not fit the pool (:func:`capacity_error`): a stock
request (prompt + ``max_tokens``), a budgeted one whose prompt must be held whole (no
``kv_prefill_evict``), or one whose bounded peak is too big. In a pool that holds
``max_model_len`` tokens this never triggers: vLLM's own length checks already imply it.
"""

from __future__ import annotations

from obcache_vllm.eviction.planning import peak_blocks
from obcache_vllm.options import KvOptions, KvOptionsError


def pool_blocks(vllm_config) -> int | None:
    """Blocks a request can use (the null block excluded); None before the engine is up."""
    blocks = vllm_config.cache_config.num_gpu_blocks
    return None if not blocks else blocks - 1


def capacity_error(
    vllm_config, prompt_len: int, max_tokens: int | None, options: KvOptions | None
) -> KvOptionsError | None:
    """Why this request can never fit the KV pool, or None (see the module docstring)."""
    usable = pool_blocks(vllm_config)
    if usable is None:
        return None
    block_size = vllm_config.cache_config.block_size
    # kv_when "pressure": a prompt that does not fit is admitted compressed while prefilled.
    bounded = options is not None and (options.prefill_evict or options.when == "pressure")
    if max_tokens is None:
        max_tokens = vllm_config.model_config.max_model_len - prompt_len
    peak = peak_blocks(
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        block_size=block_size,
        chunk=vllm_config.scheduler_config.max_num_batched_tokens,
        budget=None if options is None or options.max_error is not None else options.budget,
        decode=options is not None and options.decode,
        prefill_evict=bounded,
        point=None if options is None else options.compress_point(prompt_len),
    )
    if peak <= usable:
        return None
    need = f"needs up to {peak} KV blocks but the pool holds {usable} (of {block_size} tokens)"
    if options is None:
        return KvOptionsError(
            "max_tokens",
            f"the request {need}: lower max_tokens, or send kv_budget with kv_prefill_evict",
            max_tokens,
        )
    if not bounded and -(-prompt_len // block_size) > usable:
        return KvOptionsError(
            "kv_prefill_evict",
            f"the prompt alone {need}: set kv_prefill_evict to evict while it is prefilled",
            False,
        )
    hint = "" if options.decode else ", or set kv_decode"
    if options.compress_at is not None and options.compress_at < prompt_len:
        hint += " (the prompt after kv_compress_at is kept whole)"
    return KvOptionsError(
        "kv_budget", f"the request {need}: lower kv_budget or max_tokens{hint}", options.budget
    )
