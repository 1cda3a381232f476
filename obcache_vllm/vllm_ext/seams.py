"""The vLLM internals obcache-vllm relies on, pinned: versions, signatures, attributes, state.

:func:`check_compatibility` runs at start in every process (from :func:`~obcache_vllm.
vllm_ext.install.install`); a mismatch raises :class:`IncompatibleVllmError` and vLLM refuses to
start, rather than silently compacting KV through a changed interface. The tables list every
internal the adapters read, write or patch, with the parameters our code passes or overrides.
"""

from __future__ import annotations

import importlib
import inspect

SUPPORTED_VLLM = ("0.32.0", "0.33.0")

# (module, qualname, parameter names that our code passes or overrides)
SEAMS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vllm.config.scheduler", "SchedulerConfig.get_scheduler_cls", ("self",)),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.__init__",
        (
            "self",
            "vllm_config",
            "kv_cache_config",
            "structured_output_manager",
            "block_size",
            "hash_block_size",
            "mm_registry",
            "include_finished_set",
            "log_stats",
        ),
    ),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule", ("self", "throttle_prefills")),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.update_from_output",
        ("self", "scheduler_output", "model_runner_output"),
    ),
    ("vllm.v1.core.sched.scheduler", "Scheduler.add_request", ("self", "request")),
    # Not patched, but OBCacheScheduler._cut_chunk_at undoes exactly what it advances.
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler._update_after_schedule",
        ("self", "scheduler_output"),
    ),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler._preempt_request",
        ("self", "request", "timestamp", "drop_stale_output"),
    ),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler._free_request",
        ("self", "request", "delay_free_blocks"),
    ),
    (
        "vllm.v1.core.single_type_kv_cache_manager",
        "SingleTypeKVCacheManager._remove_blocks_in_range",
        ("self", "request_id", "first_block", "last_block"),
    ),
    (
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator.cache_blocks",
        ("self", "request", "num_computed_tokens"),
    ),
    ("vllm.v1.core.block_pool", "BlockPool.is_block_writable", ("self", "block")),
    # The prefix cache (engine/prefix.py, engine/blocks.py): the one lookup of a new or
    # resumed request, trimming a hit, building one, vLLM's copy-on-write of hit blocks
    # (drained into SchedulerOutput.kv_cache_block_copies, run by the worker before the
    # forward pass), entry tags and their events, registering preserved stock blocks.
    ("vllm.v1.core.sched.scheduler", "Scheduler._get_local_prefix_cache_hit", ("self", "request")),
    ("vllm.v1.core.sched.scheduler", "Scheduler.finish_requests",
     ("self", "request_ids", "finished_status")),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.truncate_computed_blocks",
     ("self", "blocks", "num_computed_tokens")),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.create_kv_cache_blocks", ("self", "blocks")),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.reset_prefix_cache", ("self",)),
    # A step's copies are drained here (chains resolved: engine/blocks.py) and run by the
    # worker as one gather then one scatter, which is why a chain would read stale KV.
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.take_kv_cache_block_copies", ("self",)),
    ("vllm.v1.worker.utils", "copy_kv_cache_blocks_inplace",
     ("kv_caches", "num_blocks", "kv_cache_block_copies")),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager._apply_cow",
     ("self", "request_id", "block_idx", "source_block", "cow_block")),
    ("vllm.v1.core.block_pool", "BlockPool._insert_block_hash",
     ("self", "block_hash_with_group_id", "block", "num_tokens")),
    ("vllm.v1.core.block_pool", "BlockPool.cache_full_blocks",
     ("self", "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size",
      "kv_cache_group_id")),
    ("vllm.v1.core.block_pool", "BlockPool.touch", ("self", "blocks")),
    ("vllm.v1.core.block_pool", "BlockPool.get_new_blocks", ("self", "num_blocks")),
    ("vllm.v1.core.block_pool", "BlockPool.free_blocks", ("self", "ordered_blocks")),
    ("vllm.v1.core.block_pool", "BlockPool.evict_blocks", ("self", "block_ids")),
    ("vllm.v1.core.block_pool", "BlockPool._emit_block_removed_events", ("self", "block_hashes")),
    ("vllm.v1.core.kv_cache_utils", "make_block_hash_with_group_id", ("block_hash", "group_id")),
    # kv_prefill_evict: admission by bounded peak (scheduler.py), pools smaller than the
    # context (capacity.py).
    (
        "vllm.v1.core.kv_cache_manager",
        "KVCacheManager.allocate_slots",
        ("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
         "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks",
         "num_encoder_tokens", "full_sequence_must_fit"),
    ),
    (
        "vllm.v1.engine.core",
        "get_kv_cache_configs",
        ("vllm_config", "kv_cache_specs", "available_memory"),
    ),
    (
        "vllm.v1.core.kv_cache_utils",
        "_check_enough_kv_cache_memory",
        ("available_memory", "get_needed_memory", "max_model_len", "estimate_max_model_len"),
    ),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.execute_model",
        ("self", "scheduler_output", "intermediate_tensors"),
    ),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens", ("self", "grammar_output")),
    # Seeded sampling under chunked prefill with CPU generators (seeded.py): vLLM rewinds the
    # generator of a discarded row with Philox-only set_offset(get_offset() - 4) in
    # _bookkeeping_sync (vllm-project/vllm#10097: "relies on cuda-specific torch-internal impl
    # details"); a CPU (mt19937) generator raises "CPU Generator does not use offset" and the
    # engine dies. We snapshot/restore those generators around _sample and hide them from the
    # rewind. Same bug elsewhere: RBLN-SW/vllm-rbln#1025, qualcomm/vllm-qaic#92.
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._sample",
        ("self", "logits", "spec_decode_metadata"),
    ),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._bookkeeping_sync",
        (
            "self",
            "scheduler_output",
            "sampler_output",
            "logits",
            "hidden_states",
            "num_scheduled_tokens",
        ),
    ),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._build_attention_metadata",
        (
            "self",
            "num_tokens",
            "num_reqs",
            "max_query_len",
            "num_tokens_padded",
            "num_reqs_padded",
            "ubatch_slices",
            "logits_indices",
            "max_num_sampled_tokens",
            "use_spec_decode",
            "for_cudagraph_capture",
            "num_scheduled_tokens",
            "slot_mappings",
        ),
    ),
    (
        "vllm.v1.attention.backends.cpu_attn",
        "CPUAttentionMetadataBuilder.build",
        ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
    ),
    (
        "vllm.v1.attention.backends.cpu_attn",
        "CPUAttentionBackendImpl.forward",
        (
            "self",
            "layer",
            "query",
            "key",
            "value",
            "kv_cache",
            "attn_metadata",
            "output",
            "output_scale",
            "output_block_scale",
        ),
    ),
    (
        "vllm._custom_ops",
        "cpu_attn_reshape_and_cache",
        (
            "key",
            "value",
            "key_cache",
            "value_cache",
            "slot_mapping",
            "isa",
            "k_scale",
            "v_scale",
            "kv_cache_dtype",
        ),
    ),
    (
        "vllm.v1.engine.input_processor",
        "InputProcessor.process_inputs",
        ("self", "request_id", "prompt", "params"),
    ),
    ("vllm.v1.attention.backends.registry", "register_backend", ("backend", "class_path")),
    # frontend/admission.py: the prompt length of token-id and prompt-embeds requests alike.
    (
        "vllm.utils",
        "length_from_prompt_token_ids_or_embeds",
        ("prompt_token_ids", "prompt_embeds"),
    ),
    # server.py: the rendered prompt's token ids / embeddings in the generate handlers.
    (
        "vllm.entrypoints.serve.engine.serving",
        "BaseServing._extract_prompt_components",
        ("self", "prompt"),
    ),
    # Teacher forcing (forcing.py): a v1 batch-level logits processor, applied by the sampler
    # AFTER the raw logprobs are computed (Sampler.forward), so forced tokens keep model logprobs.
    (
        "vllm.v1.sample.logits_processor",
        "LogitsProcessor.__init__",
        ("self", "vllm_config", "device", "is_pin_memory"),
    ),
    ("vllm.v1.sample.logits_processor", "LogitsProcessor.update_state", ("self", "batch_update")),
    ("vllm.v1.sample.logits_processor", "LogitsProcessor.apply", ("self", "logits")),
    (
        "vllm.v1.sample.sampler",
        "Sampler.forward",
        ("self", "logits", "sampling_metadata", "predict_bonus_token", "logprobs_mode_override"),
    ),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.make_stats",
        (
            "self",
            "spec_decoding_stats",
            "kv_connector_stats",
            "cudagraph_stats",
            "perf_stats",
            "ec_connector_stats",
        ),
    ),
    (
        "vllm.v1.metrics.loggers",
        "PrometheusStatLogger.__init__",
        ("self", "vllm_config", "engine_indexes"),
    ),
    (
        "vllm.v1.metrics.loggers",
        "PrometheusStatLogger.record",
        ("self", "scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"),
    ),
    ("vllm.v1.engine.async_llm", "load_stat_logger_plugin_factories", ()),
    (
        "vllm.entrypoints.openai.chat_completion.protocol",
        "ChatCompletionRequest.to_sampling_params",
        ("self", "max_tokens", "default_sampling_params"),
    ),
    (
        "vllm.entrypoints.openai.completion.protocol",
        "CompletionRequest.to_sampling_params",
        ("self", "max_tokens", "default_sampling_params"),
    ),
    (
        "vllm.entrypoints.serve.engine.serving",
        "BaseServing._log_inputs",
        ("self", "request_id", "inputs", "params", "lora_request"),
    ),
    (
        "vllm.entrypoints.openai.chat_completion.serving",
        "OpenAIServingChat.chat_completion_full_generator",
        ("self", "request", "result_generator"),
    ),
    (
        "vllm.entrypoints.openai.chat_completion.serving",
        "OpenAIServingChat.chat_completion_stream_generator",
        ("self", "request", "result_generator"),
    ),
    (
        "vllm.entrypoints.openai.completion.serving",
        "OpenAIServingCompletion.completion_stream_generator",
        ("self", "request", "engine_inputs", "result_generator"),
    ),
    (
        "vllm.entrypoints.openai.completion.serving",
        "OpenAIServingCompletion.request_output_to_completion_response",
        ("self", "final_res_batch"),
    ),
    (
        "vllm.entrypoints.launchers.app",
        "register_api_routers",
        ("args", "app", "supported_tasks", "model_config"),
    ),
)

# Where a later vLLM moved or extended a seam: version -> {(module, qualname): new row}.
# Read statically from the 0.33.0 wheel (make compat VLLM=0.33.0, results/compat/); the
# plugin's patches use :func:`module_of` so they install on either version. 0.33.0 has not
# run here (the CPU build on PyPI is 0.32.0): it passes the static check only.
VERSIONED_SEAMS: dict[str, dict[tuple[str, str], tuple[str, str, tuple[str, ...]]]] = {
    "0.33.0": {
        ("vllm.v1.core.kv_cache_utils", "_check_enough_kv_cache_memory"): (
            "vllm.v1.core.kv_cache_planning",
            "_check_enough_kv_cache_memory",
            ("available_memory", "get_needed_memory", "max_model_len", "estimate_max_model_len"),
        ),
        ("vllm.v1.core.sched.scheduler", "Scheduler._get_local_prefix_cache_hit"): (
            "vllm.v1.core.sched.scheduler",
            "Scheduler._get_local_prefix_cache_hit",
            ("self", "request", "max_cache_hit_length"),
        ),
    },
}


def seams_for(version: str) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """:data:`SEAMS` as they stand in vLLM ``version`` (moved rows replaced)."""
    moved = VERSIONED_SEAMS.get(version, {})
    return tuple(moved.get((mod, name), (mod, name, params)) for mod, name, params in SEAMS)


def module_of(module: str, qualname: str, version: str | None = None) -> str:
    """The module that holds ``module.qualname`` in the installed (or the given) vLLM."""
    if version is None:
        import vllm

        version = vllm.__version__
    return VERSIONED_SEAMS.get(version, {}).get((module, qualname), (module,))[0]


# Attributes (not callables) we read or write.
ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("vllm.v1.worker.cpu_worker", "CPUModelRunner"),
    ("vllm.v1.core.sched.output", "SchedulerOutput"),
    ("vllm.v1.outputs", "ModelRunnerOutput"),
    ("vllm.v1.sample.logits_processor", "BatchUpdate"),
    ("vllm.v1.sample.logits_processor", "MoveDirectionality"),
    ("vllm.v1.engine", "EngineCoreOutput.kv_transfer_params"),
    ("vllm.outputs", "RequestOutput"),
    ("vllm.v1.metrics.stats", "SchedulerStats"),
    ("vllm.entrypoints.serve.engine.protocol", "UsageInfo"),
)


# Instance state we read or write, as (module, class, attribute names): dataclass fields, or
# attributes assigned in ``__init__`` (checked in its source).
STATE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # seeded.py: the rows whose sampled token is dropped, and their per-request generators.
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        ("input_batch", "discard_request_mask"),
    ),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch", ("generators", "num_reqs")),
    # frontend/admission.py: what budgeted requests are refused with (read in the front end).
    (
        "vllm.config.parallel",
        "ParallelConfig",
        (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "decode_context_parallel_size",
            "prefill_context_parallel_size",
        ),
    ),
    ("vllm.config.scheduler", "SchedulerConfig", ("async_scheduling", "scheduler_cls")),
    ("vllm.config.cache", "CacheConfig",
     ("cache_dtype", "kv_sharing_fast_prefill", "enable_prefix_caching")),
    (
        "vllm.config.model",
        "ModelConfig",
        ("max_model_len", "hf_text_config", "use_mla", "is_hybrid", "is_attention_free"),
    ),
    (
        "vllm.v1.engine",
        "EngineCoreRequest",
        ("prompt_token_ids", "prompt_embeds", "sampling_params"),
    ),
    # server.py: the generate handlers' engine client and its config.
    ("vllm.entrypoints.generate.base.serving", "GenerateBaseServing", ("engine_client",)),
    ("vllm.v1.engine.async_llm", "AsyncLLM", ("vllm_config",)),
    (
        "vllm.v1.core.sched.output",
        "SchedulerOutput",
        ("num_scheduled_tokens", "total_num_scheduled_tokens"),
    ),
    (
        "vllm.v1.request",
        "Request",
        ("num_computed_tokens", "num_in_flight_tokens", "is_prefill_chunk", "num_prompt_tokens",
         "block_hashes", "cache_salt", "lora_request", "skip_reading_prefix_cache",
         "mm_features"),
    ),
    (
        "vllm.v1.core.single_type_kv_cache_manager",
        "SingleTypeKVCacheManager",
        ("req_to_blocks", "_pending_cow_copies", "new_block_ids", "block_size",
         "num_cached_block"),
    ),
    ("vllm.v1.core.block_pool", "BlockPool", ("blocks", "null_block", "hash_block_size",
                                               "cached_block_hash_to_block")),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", ("enable_caching", "block_pool",
                                                         "empty_kv_cache_blocks")),
    ("vllm.v1.core.sched.output", "SchedulerOutput", ("scheduled_new_reqs",
                                                      "scheduled_cached_reqs",
                                                      "kv_cache_block_copies")),
    # The KV oracle (worker/runner.py): each request's block list and computed tokens.
    ("vllm.v1.worker.gpu_input_batch", "CachedRequestState", ("block_ids", "num_computed_tokens")),
)

# The module whose presence means "this process serves vLLM's OpenAI API" (imported by the
# `vllm serve` entry point before plugins load; never by EngineCore or worker processes).
# install() tests it BEFORE anything is imported: check_compatibility() used to import it (a
# SEAMS module) first, so every process installed the server patches.
API_SERVER_MODULE = "vllm.entrypoints.launchers.app"
# The seams of the API-server process: checked, imported and patched there only.
SERVER_MODULE_PREFIXES = ("vllm.entrypoints.", "vllm.v1.engine.async_llm")


class IncompatibleVllmError(RuntimeError):
    """The installed vLLM does not match what obcache-vllm was built and tested against."""


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def is_server_module(module: str) -> bool:
    """A module of the OpenAI API server (front-end only: never imported by EngineCore/workers
    on our behalf)."""
    return module.startswith(SERVER_MODULE_PREFIXES)


def signature_problems(seams) -> list[str]:
    """One line per (module, qualname, leading parameters) of ``seams`` that is missing or
    whose signature no longer starts with those parameters."""
    problems = []
    for module, qualname, params in seams:
        try:
            names = tuple(inspect.signature(_resolve(module, qualname)).parameters)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{qualname}: missing ({exc})")
            continue
        if names[: len(params)] != params:
            problems.append(f"{module}.{qualname}: parameters {names}, expected {params}")
    return problems


def check_compatibility(include_server: bool = True) -> None:
    """Raise :class:`IncompatibleVllmError` unless every seam is exactly as expected.

    ``include_server=False`` skips the API server's seams (:func:`is_server_module`) without
    importing their modules: the check of a process that does not serve the OpenAI API.
    """
    import vllm

    if vllm.__version__ not in SUPPORTED_VLLM:
        raise IncompatibleVllmError(
            f"obcache-vllm supports vLLM {', '.join(SUPPORTED_VLLM)}; found {vllm.__version__}"
        )
    seams = [s for s in seams_for(vllm.__version__)
             if include_server or not is_server_module(s[0])]  # fmt: skip
    problems = signature_problems(seams)
    for module, name in ATTRIBUTES:
        if not include_server and is_server_module(module):
            continue
        try:
            _resolve(module, name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{name}: missing ({exc})")
    for module, name, attrs in STATE:
        if not include_server and is_server_module(module):
            continue
        try:
            cls = _resolve(module, name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{name}: missing ({exc})")
            continue
        # dataclass fields, msgspec struct fields, or assignments in __init__'s source
        fields = getattr(cls, "__dataclass_fields__", None) or getattr(
            cls, "__struct_fields__", None
        )
        source = "" if fields is not None else inspect.getsource(cls.__init__)
        for attr in attrs:
            if fields is not None and attr in fields:
                continue
            if f"self.{attr} =" in source or f"self.{attr}:" in source:
                continue
            if isinstance(getattr(cls, attr, None), property):
                continue
            problems.append(f"{module}.{name}.{attr}: missing")
    if problems:
        raise IncompatibleVllmError("vLLM internals changed:\n  " + "\n  ".join(problems))
