"""What a budgeted request can be served with: refused at the front end, never in the engine.

A request with a ``kv_budget`` is checked twice before anything is allocated for it, each time
with the same function (:func:`check_request`):

* by the OpenAI server's generate handlers (``server._wrap_log_inputs``), on the rendered
  prompt, before the stream starts: a refusal is an HTTP 400 for streams too;
* by vLLM's input processor (:func:`validate_request`, patched in by ``install``), for every
  front end including offline ``LLM``.

A refusal is a :class:`~obcache_vllm.options.KvOptionsError` naming the field (``kv_budget``
for what the engine cannot do, ``kv_per_head`` for the per-layer ranking under tensor
parallelism), which the edge turns into ``VLLMValidationError`` (HTTP 400). Requests without a
budget are never refused: they are stock vLLM requests.

Refused with a budget, and why:

================================  ==========================================================
configuration                     why eviction cannot run (or cannot run correctly)
================================  ==========================================================
platform / backend settings       the adapter's own refusals: none on CPU; on CUDA those of
                                  FLASH_ATTN (README, "GPUs"); other platforms: no adapter
speculative decoding              rejected drafts roll back KV that may have been compacted
KV connectors / offloading        they assume positional block contents
quantized KV cache                scoring needs the scales; the layout probe is per dtype
pipeline parallelism              layers (and their compactions) split across stages
hybrid / attention-free models    several KV groups with different block sizes
sliding-window models             vLLM already frees their head blocks itself
V2 model runner                   the eviction path hooks the V1 runner
async scheduling                  orders would be planned on stale state (a step ahead)
``--scheduler-cls`` not ours      EngineCore would build a scheduler that never evicts
KV-sharing layers                 a layer reading another layer's cache would see it
                                  compacted under it
MLA                               latent KV (one compressed head), another cache layout
decode/prefill context parallel   a request's KV is split across ranks
prompt embeddings                 the worker tracks token-id prompts only: scheduler and
                                  worker would disagree on the request (engine death)
``kv_per_head: false`` with TP    one ranking per layer needs every KV head's scores; TP
                                  splits heads across ranks. The ranking's all-reduce exists
                                  (2 gloo ranks tested) but has not run in vLLM's TP engine
================================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from obcache_vllm.options import KvOptions, KvOptionsError, parse_kv_options


def unsupported_reason(vllm_config) -> str | None:
    """Why budgeted requests cannot be served by this engine configuration, or None."""
    from obcache_vllm.vllm_ext.worker.backends import platform_unsupported_reason

    reason = platform_unsupported_reason(vllm_config)  # the attention backend's adapter
    if reason is not None:
        return reason
    if vllm_config.speculative_config is not None:
        return "speculative decoding is not supported with kv_budget"
    if vllm_config.kv_transfer_config is not None:
        return "KV connectors / offloading are not supported with kv_budget"
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
        return f"quantized KV cache ({cache_dtype}) is not supported with kv_budget"
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        return "pipeline parallelism is not supported with kv_budget"
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        return (
            "context parallelism (decode_context_parallel_size="
            f"{parallel.decode_context_parallel_size}, prefill_context_parallel_size="
            f"{parallel.prefill_context_parallel_size}) is not supported with kv_budget"
        )
    model_config = vllm_config.model_config
    if model_config.is_hybrid or model_config.is_attention_free:
        return "hybrid / attention-free models are not supported with kv_budget"
    if model_config.get_sliding_window() is not None:
        return "sliding-window models are not supported with kv_budget"
    if model_config.use_mla:
        return "MLA (multi-head latent attention) models are not supported with kv_budget"
    shared = getattr(model_config.hf_text_config, "num_kv_shared_layers", 0) or 0
    if shared > 0 or vllm_config.cache_config.kv_sharing_fast_prefill:
        return (
            f"models with KV-sharing layers ({shared} layers reuse another layer's KV cache) "
            "are not supported with kv_budget"
        )
    if vllm_config.use_v2_model_runner:
        return "the V2 model runner is not supported with kv_budget (VLLM_USE_V2_MODEL_RUNNER=0)"
    return _scheduler_reason(vllm_config.scheduler_config)


def _scheduler_reason(scheduler_config) -> str | None:
    """The scheduler EngineCore builds must be ours (``install._wrap_get_scheduler_cls``)."""
    if scheduler_config.async_scheduling:
        return "async scheduling is not supported with kv_budget (--no-async-scheduling)"
    from vllm.v1.core.sched.scheduler import Scheduler

    from obcache_vllm.vllm_ext.engine.scheduler import OBCacheScheduler

    try:
        cls = scheduler_config.get_scheduler_cls()
    except Exception as exc:  # a user class that does not import here
        return f"--scheduler-cls {scheduler_config.scheduler_cls!r} could not be checked ({exc})"
    # vLLM's own Scheduler is what EngineCore replaces by OBCacheScheduler.
    if cls is Scheduler or (isinstance(cls, type) and issubclass(cls, OBCacheScheduler)):
        return None
    name = scheduler_config.scheduler_cls
    if not isinstance(name, str):
        name = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"
    return (
        f"--scheduler-cls {name} is not supported with kv_budget: it must be (a subclass of) "
        "obcache_vllm.vllm_ext.engine.scheduler.OBCacheScheduler"
    )


def check_request(
    vllm_config,
    extra_args: Mapping[str, Any] | None,
    num_prompt_tokens: int,
    *,
    prompt_embeds: bool = False,
) -> KvOptions | None:
    """The request's options, or ``None`` (no budget); raises ``KvOptionsError`` if refused.

    ``prompt_embeds``: the prompt carries embeddings (all or some of its positions).
    """
    max_model_len = vllm_config.model_config.max_model_len
    options = parse_kv_options(extra_args, num_prompt_tokens, max_model_len)
    if options is None:
        return None
    reason = unsupported_reason(vllm_config)
    if reason is not None:
        raise KvOptionsError("kv_budget", reason, options.budget)
    if prompt_embeds:
        raise KvOptionsError(
            "kv_budget",
            "not supported for requests with prompt embeddings (prompt_embeds)",
            options.budget,
        )
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp > 1 and not options.per_head:
        raise KvOptionsError(
            "kv_per_head",
            f"false (one ranking per layer) is not supported with tensor parallelism "
            f"(tensor_parallel_size={tp}) until it has been checked in vLLM's tensor-parallel "
            "engine (each rank holds only its own KV heads' scores); use kv_per_head: true",
            False,
        )
    return options


def validate_request(vllm_config, engine_request) -> None:
    """Input-processor check of one ``EngineCoreRequest``; raises ``VLLMValidationError``."""
    params = engine_request.sampling_params
    if params is None or not params.extra_args:
        return
    from vllm.exceptions import VLLMValidationError
    from vllm.utils import length_from_prompt_token_ids_or_embeds

    embeds = engine_request.prompt_embeds
    num_prompt = length_from_prompt_token_ids_or_embeds(engine_request.prompt_token_ids, embeds)
    try:
        check_request(vllm_config, params.extra_args, num_prompt, prompt_embeds=embeds is not None)
    except KvOptionsError as exc:
        from obcache_vllm.vllm_ext.frontend.stats import count_rejection

        count_rejection(exc.field)
        raise VLLMValidationError(str(exc), parameter=exc.field, value=exc.shown_value) from exc


def check_capacity(vllm_config, engine_request) -> None:
    """Input-processor check that the request can ever fit the KV pool (:mod:`.capacity`);
    raises ``VLLMValidationError`` naming the field."""
    params = engine_request.sampling_params
    if params is None:
        return
    from vllm.exceptions import VLLMValidationError
    from vllm.utils import length_from_prompt_token_ids_or_embeds

    from obcache_vllm.vllm_ext.frontend.capacity import capacity_error

    try:
        num_prompt = length_from_prompt_token_ids_or_embeds(
            engine_request.prompt_token_ids, engine_request.prompt_embeds
        )
        options = parse_kv_options(params.extra_args, num_prompt)
    except (ValueError, KvOptionsError):
        return  # no prompt to hold, or refused by validate_request already
    error = capacity_error(vllm_config, num_prompt, params.max_tokens, options)
    if error is not None:
        from obcache_vllm.vllm_ext.frontend.stats import count_rejection

        count_rejection(error.field)
        raise VLLMValidationError(str(error), parameter=error.field, value=error.shown_value)
