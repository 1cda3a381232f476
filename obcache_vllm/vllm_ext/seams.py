"""The registry of every vLLM internal obcache-vllm relies on, and the one place that patches.

:data:`REGISTRY` has one :class:`Seam` row per private vLLM name the adapters read, call,
subclass or replace: where it is, its leading parameters, how we touch it (:data:`HOWS`), in
which process and for which attention backend, and what we install. Everything reads these rows:

* :func:`check_compatibility` at start in every process (from :func:`~obcache_vllm.vllm_ext.
  install.install`): a mismatch raises :class:`IncompatibleVllmError` and vLLM refuses to
  start, rather than silently compacting KV through a changed interface;
* :func:`apply` installs the ``wrap``/``replace``/``backend``/``field`` rows, and :func:`bind`
  the ``instance`` rows on the objects vLLM builds. No other module patches vLLM
  (``tests/unit/test_seam_registry.py`` fails on one that does);
* ``make compat`` (:mod:`.compat`) checks the same rows statically against another release;
* ``scripts/gen_reference.py`` writes the docs' seam table from them.

Importing this module imports no vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

SUPPORTED_VLLM = ("0.32.0", "0.33.0")

# How obcache-vllm touches a seam (Seam.how). The first five are applied by install() or bind()
# and only there; the rest are checked, not changed.
HOWS = {
    "wrap": "replaced on its class or module by `install(original)`, once (install)",
    "instance": "replaced on the one instance vLLM builds, by `bind()` (at run time)",
    "replace": "a module global replaced by the object `install` (install)",
    "backend": "vLLM's backend of that name replaced by the class `install` (install, through "
    "vLLM's `register_backend`)",
    "field": "`attrs` added to the dataclass, default None (install)",
    "override": "overridden in the subclass `install`",
    "call": "called or read as it is",
    "attribute": "a class or attribute read or written",
    "state": "instance attributes `attrs` read or written (dataclass or msgspec fields, or "
    "assignments in `__init__`)",
    "absent": "must not exist: the adapter relies on its absence",
}
APPLIED = ("wrap", "replace", "backend", "field")  # by install(), in table order
# Which process a seam belongs to (Seam.process). Only "server" rows are process-specific when
# installing: the others are checked and applied in every vLLM process (each process uses its
# own part).
PROCESSES = ("every", "frontend", "server", "engine", "worker")
BACKENDS = ("any", "cpu", "cuda")


@dataclass(frozen=True)
class Seam:
    """One private vLLM name obcache-vllm reads, calls, subclasses or patches.

    ``module`` and ``qualname`` locate it (in vLLM 0.32.0; :data:`VERSIONED_SEAMS` says where a
    later release moved it). ``params``: for a callable, the leading parameter names our code
    passes or overrides (checked against ``inspect.signature``); None for a class, attribute or
    state. ``how``: one of :data:`HOWS`. ``process`` and ``backend``: where it is used (one of
    :data:`PROCESSES`, :data:`BACKENDS`). ``install``: ``"module:attr"`` of what is installed
    (the wrapper factory, the replacing object, our subclass) or a backend's class path.
    ``attrs``: the attribute names of a ``state`` or ``field`` row. ``why``: one line for the
    docs' seam table.
    """

    module: str
    qualname: str
    params: tuple[str, ...] | None = None
    how: str = "call"
    process: str = "engine"
    backend: str = "any"
    install: str = ""
    attrs: tuple[str, ...] = ()
    why: str = ""

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


_SCHED = "vllm.v1.core.sched.scheduler"
_OURS_SCHED = "obcache_vllm.vllm_ext.engine.scheduler:OBCacheScheduler"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_OURS_RUNNER = "obcache_vllm.vllm_ext.worker.backends.cpu:OBCacheCPUModelRunner"
_KVM = "vllm.v1.core.kv_cache_manager"
_POOL = "vllm.v1.core.block_pool"
_STM = "vllm.v1.core.single_type_kv_cache_manager"
_SERVER = "obcache_vllm.vllm_ext.frontend.server"
_FA = "vllm.v1.attention.backends.flash_attn"
_OURS_FA = "obcache_vllm.vllm_ext.worker.backends.flash_attn"
S = Seam

# Every private vLLM name obcache-vllm relies on. install() applies the APPLIED rows,
# check_compatibility() checks every row at start-up, `make compat` reads them statically from
# another release, and scripts/gen_reference.py writes the docs' seam table from them.
REGISTRY: tuple[Seam, ...] = (
    # -- every process ---------------------------------------------------------------------
    S("vllm.v1.metrics.stats", "SchedulerStats", how="field", process="every", attrs=("obcache",),
      why="the engine's eviction counters ride to the front end; msgspec drops unknown "
      "attributes, so a real field (wire.py)"),
    S("vllm.config.scheduler", "SchedulerConfig.get_scheduler_cls", ("self",), how="wrap",
      process="every", install="obcache_vllm.vllm_ext.install:_wrap_get_scheduler_cls",
      why="vLLM's synchronous Scheduler becomes OBCacheScheduler"),
    # -- the front end (API server or offline LLM): admission ----------------------------------
    S("vllm.v1.engine.input_processor", "InputProcessor.process_inputs",
      ("self", "request_id", "prompt", "params"), how="wrap", process="frontend",
      install="obcache_vllm.vllm_ext.install:_wrap_process_inputs",
      why="the last step of admission: the options leave in their wire form, or a 400"),
    S("vllm.v1.engine.input_processor", "InputProcessor", how="state", process="frontend",
      attrs=("vllm_config",),
      why="the engine configuration admission is built from (one Admission per processor)"),
    S("vllm.v1.engine", "EngineCoreRequest", how="state", process="frontend",
      attrs=("prompt_token_ids", "prompt_embeds", "sampling_params", "cache_salt",
             "lora_request", "session_id", "resumable", "kv_hints"),
      why="what admission reads of a request"),
    S("vllm.config.parallel", "ParallelConfig", how="state", process="frontend",
      attrs=("tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size",
             "prefill_context_parallel_size"),
      why="what budgeted requests are refused with"),
    S("vllm.config.scheduler", "SchedulerConfig", how="state", process="frontend",
      attrs=("async_scheduling", "scheduler_cls", "disable_hybrid_kv_cache_manager"),
      why="refusals"),
    S("vllm.config.cache", "CacheConfig", how="state", process="frontend",
      attrs=("cache_dtype", "kv_sharing_fast_prefill", "enable_prefix_caching"), why="refusals"),
    S("vllm.config.model", "ModelConfig", how="state", process="frontend",
      attrs=("max_model_len", "hf_text_config", "use_mla", "is_hybrid", "is_attention_free"),
      why="refusals, the context length"),
    S("vllm.outputs", "RequestOutput", how="attribute", process="frontend",
      why="the outcome of a budgeted request reaches the client on it"),
    S("vllm.v1.engine", "EngineCoreOutput.kv_transfer_params", how="attribute", process="every",
      why='carries {"obcache": outcome} from EngineCore to the front end'),
    # -- the API server only --------------------------------------------------------------------
    S("vllm.entrypoints.openai.chat_completion.protocol",
      "ChatCompletionRequest.to_sampling_params", ("self", "max_tokens",
                                                   "default_sampling_params"),
      how="wrap", process="server",
      install=f"{_SERVER}:_wrap_to_sampling_params",
      why="kv_* fields (body, vllm_xargs) and the server defaults into extra_args, or a 400"),
    S("vllm.entrypoints.openai.completion.protocol", "CompletionRequest.to_sampling_params",
      ("self", "max_tokens", "default_sampling_params"), how="wrap", process="server",
      install=f"{_SERVER}:_wrap_to_sampling_params", why="as for chat"),
    S("vllm.entrypoints.openai.chat_completion.protocol",
      "ChatCompletionRequest.to_beam_search_params", ("self", "max_tokens",
                                                      "default_sampling_params"),
      how="wrap", process="server", install=f"{_SERVER}:_wrap_to_beam_search_params",
      why="kv_* fields with beam search: a 400"),
    S("vllm.entrypoints.openai.completion.protocol", "CompletionRequest.to_beam_search_params",
      ("self", "max_tokens", "default_sampling_params"), how="wrap", process="server",
      install=f"{_SERVER}:_wrap_to_beam_search_params", why="as for chat"),
    S("vllm.v1.engine.async_llm", "AsyncLLM.generate",
      ("self", "prompt", "sampling_params", "request_id", "prompt_text", "lora_request"),
      how="wrap", process="server", install=f"{_SERVER}:_wrap_generate",
      why="the rendered prompt meets its sampling parameters before a stream's 200: the "
      "policy's default budget, the prompt's length"),
    S("vllm.renderers.inputs.preprocess", "extract_prompt_components", ("model_config", "prompt"),
      process="frontend", why="the rendered prompt's token ids or embeddings (the server's "
      "admission in AsyncLLM.generate)"),
    S("vllm.entrypoints.openai.chat_completion.serving",
      "OpenAIServingChat.chat_completion_full_generator", ("self", "request", "result_generator"),
      how="wrap", process="server", install=f"{_SERVER}:_wrap_full_generator",
      why="usage.obcache on a chat response"),
    S("vllm.entrypoints.openai.chat_completion.serving",
      "OpenAIServingChat.chat_completion_stream_generator", ("self", "request",
                                                             "result_generator"),
      how="wrap", process="server", install=f"{_SERVER}:_wrap_chat_stream_generator",
      why="usage.obcache on a streamed chat's usage chunk"),
    S("vllm.entrypoints.openai.completion.serving",
      "OpenAIServingCompletion.completion_stream_generator",
      ("self", "request", "engine_inputs", "result_generator"), how="wrap", process="server",
      install=f"{_SERVER}:_wrap_completion_stream_generator",
      why="usage.obcache on a streamed completion's usage chunk"),
    S("vllm.entrypoints.openai.completion.serving",
      "OpenAIServingCompletion.request_output_to_completion_response",
      ("self", "final_res_batch"), how="wrap", process="server",
      install=f"{_SERVER}:_wrap_completion_response", why="usage.obcache on a completion"),
    S("vllm.entrypoints.launchers.app", "register_api_routers",
      ("args", "app", "supported_tasks", "model_config"), how="wrap", process="server",
      install=f"{_SERVER}:_wrap_register_api_routers",
      why="GET /v1/obcache/config; the served model (args.model), whose own selection "
      "default.yaml may hold"),
    S("vllm.v1.engine.async_llm", "load_stat_logger_plugin_factories", (), how="wrap",
      process="server", install="obcache_vllm.vllm_ext.frontend.stats:stat_logger_factories",
      why="the obcache Prometheus logger, once, where its entry point is not installed"),
    S("vllm.entrypoints.serve.engine.protocol", "UsageInfo", how="attribute", process="server",
      why="usage.obcache is an extra field of it"),
    S("vllm.entrypoints.generate.base.serving", "GenerateBaseServing", how="state",
      process="server", attrs=("engine_client",), why="the generate handlers' engine client"),
    S("vllm.v1.engine.async_llm", "AsyncLLM", how="state", process="server",
      attrs=("vllm_config", "input_processor"),
      why="its config; the server's prompt check reaches the engine's Admission through its "
      "input processor"),
    S("vllm.v1.metrics.loggers", "PrometheusStatLogger.__init__",
      ("self", "vllm_config", "engine_indexes"), how="override", process="frontend",
      install="obcache_vllm.vllm_ext.frontend.stats:OBCachePrometheusStatLogger",
      why="vLLM's Prometheus logger plus the obcache metrics"),
    S("vllm.v1.metrics.loggers", "PrometheusStatLogger.record",
      ("self", "scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"),
      how="override", process="frontend",
      install="obcache_vllm.vllm_ext.frontend.stats:OBCachePrometheusStatLogger",
      why="the engine's counters into the obcache metrics"),
    # -- EngineCore: the scheduler ---------------------------------------------------------------
    S(_SCHED, "Scheduler.__init__", ("self", "vllm_config", "kv_cache_config",
                                     "structured_output_manager", "block_size", "hash_block_size",
                                     "mm_registry", "include_finished_set", "log_stats"),
      how="override", install=_OURS_SCHED, why="the block ledger and the adapters below"),
    S(_SCHED, "Scheduler.schedule", ("self", "throttle_prefills"), how="override",
      install=_OURS_SCHED, why="eviction orders ride on the step's SchedulerOutput"),
    S(_SCHED, "Scheduler.update_from_output", ("self", "scheduler_output", "model_runner_output"),
      how="override", install=_OURS_SCHED, why="the worker's report: blocks freed, outcomes"),
    S(_SCHED, "Scheduler.add_request", ("self", "request"), how="override", install=_OURS_SCHED,
      why="a budgeted request opens its ledger"),
    S(_SCHED, "Scheduler._update_after_schedule", ("self", "scheduler_output"),
      why="not patched: OBCacheScheduler._cut_chunk_at undoes exactly what it advances"),
    S(_SCHED, "Scheduler._preempt_request", ("self", "request", "timestamp", "drop_stale_output"),
      how="override", install=_OURS_SCHED, why="a compressed request preempted: counted, logged"),
    S(_SCHED, "Scheduler._free_request", ("self", "request", "delay_free_blocks"),
      how="override", install=_OURS_SCHED, why="the ledger closed, the outcome reported"),
    S(_SCHED, "Scheduler._get_local_prefix_cache_hit", ("self", "request"), how="override",
      install=_OURS_SCHED, why="the one prefix lookup of a new or resumed request"),
    S(_SCHED, "Scheduler.finish_requests", ("self", "request_ids", "finished_status"),
      how="override", install=_OURS_SCHED, why="aborts release what the request held"),
    S(_SCHED, "Scheduler.make_stats", ("self", "spec_decoding_stats", "kv_connector_stats",
                                       "cudagraph_stats", "perf_stats", "ec_connector_stats"),
      how="override", install=_OURS_SCHED, why="the eviction counters into SchedulerStats"),
    S("vllm.v1.request", "Request", how="state",
      attrs=("num_computed_tokens", "num_in_flight_tokens", "is_prefill_chunk",
             "num_prompt_tokens", "block_hashes", "cache_salt", "lora_request",
             "skip_reading_prefix_cache", "mm_features"),
      why="what the scheduler side reads of a request"),
    S("vllm.v1.core.sched.output", "SchedulerOutput", how="state", process="every",
      attrs=("num_scheduled_tokens", "total_num_scheduled_tokens", "scheduled_new_reqs",
             "scheduled_cached_reqs", "kv_cache_block_copies"),
      why="the step; eviction orders ride on it (pickled: instance attributes survive)"),
    # -- EngineCore: blocks (engine/blocks.py, engine/prefix.py) ------------------------------
    S("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.cache_blocks",
      ("self", "request", "num_computed_tokens"), how="instance",
      install="obcache_vllm.vllm_ext.engine.blocks:PoolAdapter.cache_blocks",
      why="a budgeted request registers only stock KV below its write floor"),
    S(_KVM, "KVCacheManager.allocate_slots",
      ("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
       "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks",
       "num_encoder_tokens", "full_sequence_must_fit"),
      how="instance", install="obcache_vllm.vllm_ext.engine.blocks:PoolAdapter.allocate_slots",
      why="admission by bounded peak; copy-on-write of a hit; held entries give way"),
    S(_KVM, "KVCacheManager.take_kv_cache_block_copies", ("self",), how="instance",
      install="obcache_vllm.vllm_ext.engine.blocks:PoolAdapter.take_kv_cache_block_copies",
      why="a step's copies run as one gather then one scatter: chains resolved"),
    S(_KVM, "KVCacheManager.reset_prefix_cache", ("self",), how="instance",
      install="obcache_vllm.vllm_ext.engine.prefix:PrefixAdapter",
      why="held entries released first (vLLM resets only a pool no one holds)"),
    S(_POOL, "BlockPool._emit_block_removed_events", ("self", "block_hashes"), how="instance",
      install="obcache_vllm.vllm_ext.engine.prefix:_filter_entry_events",
      why="the removal of an entry tag is never published (nothing published its storing)"),
    S(_STM, "SingleTypeKVCacheManager._remove_blocks_in_range",
      ("self", "request_id", "first_block", "last_block"),
      why="dead head blocks back to the pool, null blocks in place"),
    S(_STM, "SingleTypeKVCacheManager._apply_cow",
      ("self", "request_id", "block_idx", "source_block", "cow_block"),
      why="copy-on-write of a prefix hit's blocks the compaction will write"),
    S(_STM, "SingleTypeKVCacheManager", how="state",
      attrs=("req_to_blocks", "_pending_cow_copies", "new_block_ids", "block_size",
             "num_cached_block"), why="a request's blocks"),
    S(_POOL, "BlockPool.is_block_writable", ("self", "block"),
      why="a block that receives kept tokens must be the request's alone and unhashed"),
    S(_POOL, "BlockPool._insert_block_hash",
      ("self", "block_hash_with_group_id", "block", "num_tokens"),
      why="entry tags on the blocks of a compressed entry"),
    S(_POOL, "BlockPool.cache_full_blocks",
      ("self", "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size",
       "kv_cache_group_id"), why="preserved stock blocks registered"),
    S(_POOL, "BlockPool.touch", ("self", "blocks"), why="an entry's blocks taken by an adopter"),
    S(_POOL, "BlockPool.get_new_blocks", ("self", "num_blocks"), why="copies' blocks"),
    S(_POOL, "BlockPool.free_blocks", ("self", "ordered_blocks"), why="entries released"),
    S(_POOL, "BlockPool.evict_blocks", ("self", "block_ids"),
      why="entry tags dropped; blocks a compression under pressure rewrites leave the cache"),
    S(_POOL, "BlockPool", how="state",
      attrs=("blocks", "null_block", "hash_block_size", "cached_block_hash_to_block",
             "num_gpu_blocks"),
      why="the pool's blocks and hashes, and its size (what a hit's copies may take)"),
    S("vllm.v1.core.kv_cache_utils", "make_block_hash_with_group_id", ("block_hash", "group_id"),
      why="entry tags are block hashes of their own kind"),
    S(_KVM, "KVCacheManager.truncate_computed_blocks", ("self", "blocks", "num_computed_tokens"),
      why="a budgeted request's hit trimmed"),
    S(_KVM, "KVCacheManager.create_kv_cache_blocks", ("self", "blocks"), why="a hit built"),
    S(_KVM, "KVCacheManager", how="state",
      attrs=("enable_caching", "block_pool", "empty_kv_cache_blocks"), why="the manager"),
    S("vllm.v1.worker.utils", "copy_kv_cache_blocks_inplace",
      ("kv_caches", "num_blocks", "kv_cache_block_copies"), process="worker",
      why="not patched: it runs copies as blocks[dst] = blocks[src], which is why chains "
      "are resolved"),
    # -- EngineCore and workers: the group budgets evict in (groups.py) ------------------------
    S("vllm.v1.kv_cache_interface", "KVCacheConfig", how="state", process="every",
      attrs=("kv_cache_groups",), why="a model's KV-cache groups (several for a hybrid model)"),
    S("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", how="state", process="every",
      attrs=("kv_cache_spec", "layer_names"), why="a group's kind and its layers"),
    S("vllm.v1.kv_cache_interface", "FullAttentionSpec", how="state", process="every",
      attrs=("block_size", "sliding_window", "attention_chunk_size"),
      why="the group of global layers, where budgets evict (exact type: not MLA or sinks)"),
    S("vllm.v1.kv_cache_interface", "SlidingWindowSpec", how="state", process="every",
      attrs=("block_size", "sliding_window"), why="sliding-window groups, left to vLLM"),
    S("vllm.v1.kv_cache_interface", "SlidingWindowSpec.max_admission_blocks_per_request",
      ("self", "max_in_flight_tokens", "max_model_len"),
      why="what a sliding-window group holds at most, added to a bounded peak"),
    S("vllm.config.vllm", "VllmConfig", how="state", attrs=("max_in_flight_tokens",),
      why="the tokens in flight a sliding window holds beside its window"),
    # -- EngineCore: start-up (engine/pool_check.py) -------------------------------------------
    S("vllm.v1.engine.core", "get_kv_cache_configs",
      ("vllm_config", "kv_cache_specs", "available_memory"), how="wrap",
      install="obcache_vllm.vllm_ext.engine.pool_check:_wrap_get_kv_cache_configs",
      why="the smallest context kv_prefill_evict can serve is known while the pool is sized"),
    S("vllm.v1.core.kv_cache_utils", "_check_enough_kv_cache_memory",
      ("available_memory", "get_needed_memory", "max_model_len", "estimate_max_model_len"),
      how="wrap", install="obcache_vllm.vllm_ext.engine.pool_check:_wrap_check_enough",
      why="a pool smaller than max_model_len is served (kv_prefill_evict; others get a 400)"),
    # -- workers: the model runner -----------------------------------------------------------
    S("vllm.v1.worker.cpu_worker", "CPUModelRunner", how="replace", process="worker",
      backend="cpu", install=_OURS_RUNNER,
      why="the CPU worker builds its runner by this module-global name"),
    S("vllm.v1.attention.backends.registry", "AttentionBackendEnum.CPU_ATTN", how="backend",
      process="worker", backend="cpu",
      install="obcache_vllm.vllm_ext.worker.backends.cpu.OBCacheCPUBackend",
      why="CPU attention with eviction, under vLLM's name"),
    S("vllm.v1.attention.backends.registry", "register_backend", ("backend", "class_path"),
      process="worker", why="how a backend row is installed"),
    S("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.__init__",
      ("self", "vllm_config", "device"), how="override", process="worker", backend="cpu",
      install=_OURS_RUNNER, why="the runner's eviction state (EvictingRunnerMixin)"),
    S(_RUNNER, "GPUModelRunner.execute_model", ("self", "scheduler_output", "intermediate_tensors"),
      how="override", process="worker", install=_OURS_RUNNER,
      why="the step's eviction plan before the forward pass"),
    S(_RUNNER, "GPUModelRunner.sample_tokens", ("self", "grammar_output"), how="override",
      process="worker", install=_OURS_RUNNER, why="the step's report after it"),
    S(_RUNNER, "GPUModelRunner._build_attention_metadata",
      ("self", "num_tokens", "num_reqs", "max_query_len", "num_tokens_padded", "num_reqs_padded",
       "ubatch_slices", "logits_indices", "max_num_sampled_tokens", "use_spec_decode",
       "for_cudagraph_capture", "num_scheduled_tokens", "slot_mappings"),
      how="override", process="worker", install=_OURS_RUNNER,
      why="the plan reaches the attention builders"),
    # Seeded sampling under chunked prefill with CPU generators (seeded.py): vLLM rewinds the
    # generator of a discarded row with Philox-only set_offset(get_offset() - 4) in
    # _bookkeeping_sync (vllm-project/vllm#10097); a CPU (mt19937) generator raises "CPU
    # Generator does not use offset" and the engine dies. We snapshot/restore those generators
    # around _sample and hide them from the rewind. Same bug: RBLN-SW/vllm-rbln#1025,
    # qualcomm/vllm-qaic#92.
    S(_RUNNER, "GPUModelRunner._sample", ("self", "logits", "spec_decode_metadata"),
      how="override", process="worker", backend="cpu", install=_OURS_RUNNER,
      why="CPU generators of discarded rows snapshotted"),
    S(_RUNNER, "GPUModelRunner._bookkeeping_sync",
      ("self", "scheduler_output", "sampler_output", "logits", "hidden_states",
       "num_scheduled_tokens"), how="override", process="worker", backend="cpu",
      install=_OURS_RUNNER, why="and hidden from vLLM's Philox-only rewind"),
    S(_RUNNER, "GPUModelRunner", how="state", process="worker",
      attrs=("input_batch", "discard_request_mask", "attn_groups", "kv_cache_config"),
      why="the rows whose sampled token is dropped; the evicting group's builders and layers"),
    S("vllm.v1.worker.gpu_input_batch", "InputBatch", how="state", process="worker",
      attrs=("generators", "num_reqs"), why="their per-request generators"),
    S("vllm.v1.worker.gpu_input_batch", "CachedRequestState", how="state", process="worker",
      attrs=("block_ids", "num_computed_tokens"),
      why="the KV oracle: each request's blocks and computed tokens"),
    S("vllm.v1.outputs", "ModelRunnerOutput", how="attribute", process="every",
      why="the worker's report rides on it (pickled)"),
    # -- workers: CPU attention (worker/backends/cpu.py) ---------------------------------------
    S("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadataBuilder.build",
      ("self", "common_prefix_len", "common_attn_metadata", "fast_build"), how="override",
      process="worker", backend="cpu",
      install="obcache_vllm.vllm_ext.worker.backends.cpu:OBCacheMetadataBuilder",
      why="block tables shifted past dead head blocks"),
    S("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.forward",
      ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
       "output_scale", "output_block_scale"), how="override", process="worker", backend="cpu",
      install="obcache_vllm.vllm_ext.worker.backends.cpu:OBCacheCPUImpl",
      why="score and compact each layer after its attention"),
    S("vllm._custom_ops", "cpu_attn_reshape_and_cache",
      ("key", "value", "key_cache", "value_cache", "slot_mapping", "isa", "k_scale", "v_scale",
       "kv_cache_dtype"), process="worker", backend="cpu",
      why="probes the paged layout at start (per ISA and KV cache dtype)"),
    S("vllm.model_executor.layers.attention.attention", "set_default_quant_scales",
      ("layer", "register_buffer"), process="worker", backend="cpu",
      why="sets each attention layer's `_k_scale_float` and `_v_scale_float` (1.0 unless the "
      "checkpoint ships scales): an fp8 cache's view dequantizes with them"),
    S("vllm._custom_ops", "cpu_attention_with_kv_cache",
      ("query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens", "scale",
       "causal", "alibi_slopes", "sliding_window", "block_table", "softcap",
       "scheduler_metadata", "s_aux", "dynamic_causal", "k_scale", "v_scale", "kv_cache_dtype"),
      process="worker", backend="cpu",
      why="per-head memory: the batch attended as one sequence per (request, KV head)"),
    S("vllm._custom_ops", "cpu_attn_get_scheduler_metadata",
      ("num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype",
       "query_start_loc", "causal", "sliding_window_size", "isa", "enable_kv_split",
       "dynamic_causal", "kv_cache_dtype"), process="worker", backend="cpu",
      why="per-head memory: the kernel's schedule for those sequences"),
    # -- workers: FlashAttention on CUDA (worker/backends/flash_attn.py) -----------------------
    S(_RUNNER, "GPUModelRunner.__init__", ("self", "vllm_config", "device"), how="override",
      process="worker", backend="cuda", install=f"{_OURS_FA}:OBCacheGPUModelRunner",
      why="the runner's eviction state; refuses cascade attention"),
    S("vllm.v1.worker.gpu_worker", "Worker._make_model_runner", ("self",), how="wrap",
      process="worker", backend="cuda", install=f"{_OURS_FA}:_wrap_make_model_runner",
      why="the V1 runner with eviction (the V2 runner: budgets refused)"),
    S("vllm.v1.attention.backends.registry", "AttentionBackendEnum.FLASH_ATTN", how="backend",
      process="worker", backend="cuda", install=f"{_OURS_FA}.OBCacheFlashAttnBackend",
      why="FlashAttention with eviction, under vLLM's name"),
    S(_FA, "FlashAttentionMetadataBuilder.build",
      ("self", "common_prefix_len", "common_attn_metadata", "fast_build"), how="override",
      process="worker", backend="cuda", install=f"{_OURS_FA}:OBCacheFlashAttnMetadataBuilder",
      why="block tables shifted in place"),
    S(_FA, "FlashAttentionImpl.forward",
      ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"),
      how="override", process="worker", backend="cuda", install=f"{_OURS_FA}:OBCacheFlashAttnImpl",
      why="score and compact each layer after its attention"),
    S("vllm.v1.worker.block_table", "BlockTable.get_device_tensor", ("self", "num_reqs"),
      process="worker", backend="cuda", why="the builder's table is a slice of this buffer"),
    S(_FA, "FlashAttentionMetadataBuilder.use_cascade_attention", how="absent", process="worker",
      backend="cuda", why="cascade attention would read a common prefix past the shifted tables"),
    # -- the evidence tooling: teacher forcing (evidence/forcing.py) ---------------------------
    # A v1 batch-level logits processor, applied by the sampler AFTER the raw logprobs are
    # computed (Sampler.forward), so forced tokens keep the model's logprobs.
    S("vllm.v1.sample.logits_processor", "LogitsProcessor.__init__",
      ("self", "vllm_config", "device", "is_pin_memory"), how="override", process="worker",
      install="obcache_vllm.evidence.forcing:ForceTokensProcessor",
      why="forced continuations (perplexity, fidelity)"),
    S("vllm.v1.sample.logits_processor", "LogitsProcessor.update_state",
      ("self", "batch_update"), how="override", process="worker",
      install="obcache_vllm.evidence.forcing:ForceTokensProcessor", why="rows tracked"),
    S("vllm.v1.sample.logits_processor", "LogitsProcessor.apply", ("self", "logits"),
      how="override", process="worker",
      install="obcache_vllm.evidence.forcing:ForceTokensProcessor", why="the forced token"),
    S("vllm.v1.sample.logits_processor", "LogitsProcessor.is_argmax_invariant", ("self",),
      how="override", process="worker",
      install="obcache_vllm.evidence.forcing:ForceTokensProcessor",
      why="it decides the argmax: runs before greedy sampling"),
    S("vllm.v1.sample.logits_processor", "LogitsProcessor.validate_params", ("sampling_params",),
      how="override", process="frontend",
      install="obcache_vllm.evidence.forcing:ForceTokensProcessor",
      why="a malformed forced continuation is refused at admission"),
    S("vllm.v1.sample.sampler", "Sampler.forward",
      ("self", "logits", "sampling_metadata", "predict_bonus_token", "logprobs_mode_override"),
      process="worker", why="raw logprobs are computed before logits processors apply"),
    S("vllm.v1.sample.logits_processor", "BatchUpdate", how="attribute", process="worker",
      why="the batch's added, removed and moved rows"),
    S("vllm.v1.sample.logits_processor", "MoveDirectionality", how="attribute", process="worker",
      why="a moved row's direction"),
)
del S


def _view(rows, how=None, callables=None, backend=None):
    return tuple(r for r in rows
                 if (how is None or r.how in how)
                 and (callables is None or (r.params is not None) == callables)
                 and (backend is None or r.backend in backend))  # fmt: skip


# The registry's rows as the static checker (compat.py) and older callers read them.
SEAMS: tuple[tuple[str, str, tuple[str, ...]], ...] = tuple(
    (r.module, r.qualname, r.params) for r in _view(REGISTRY, callables=True,
                                                    backend=("any", "cpu")))
CUDA_SEAMS: tuple[tuple[str, str, tuple[str, ...]], ...] = tuple(
    (r.module, r.qualname, r.params) for r in _view(REGISTRY, callables=True, backend=("cuda",)))
ATTRIBUTES: tuple[tuple[str, str], ...] = tuple(dict.fromkeys(
    (r.module, r.qualname) for r in _view(REGISTRY, how=("attribute", "replace", "field",
                                                           "backend"))))
STATE: tuple[tuple[str, str, tuple[str, ...]], ...] = tuple(
    (r.module, r.qualname, r.attrs) for r in _view(REGISTRY, how=("state",)))

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
    rows = _view(rows_for(version), callables=True, backend=("any", "cpu"))
    return tuple((r.module, r.qualname, r.params) for r in rows)


def rows_for(version: str, rows: tuple[Seam, ...] = REGISTRY) -> tuple[Seam, ...]:
    """The registry's rows as they stand in vLLM ``version`` (moved rows replaced)."""
    moved = VERSIONED_SEAMS.get(version, {})
    out = []
    for row in rows:
        new = moved.get((row.module, row.qualname))
        out.append(row if new is None else dataclasses.replace(
            row, module=new[0], qualname=new[1], params=new[2]))
    return tuple(out)


def module_of(module: str, qualname: str, version: str | None = None) -> str:
    """The module that holds ``module.qualname`` in the installed (or the given) vLLM."""
    if version is None:
        import vllm

        version = vllm.__version__
    return VERSIONED_SEAMS.get(version, {}).get((module, qualname), (module,))[0]


# The module whose presence means "this process serves vLLM's OpenAI API" (imported by the
# `vllm serve` entry point before plugins load; never by EngineCore or worker processes).
# install() tests it BEFORE anything is imported: check_compatibility() used to import it (a
# SEAMS module) first, so every process installed the server patches.
API_SERVER_MODULE = "vllm.entrypoints.launchers.app"
# The seams of the API-server process: checked, imported and patched there only.
SERVER_MODULE_PREFIXES = ("vllm.entrypoints.", "vllm.v1.engine.async_llm")


class IncompatibleVllmError(RuntimeError):
    """The installed vLLM does not match what obcache-vllm was built and tested against."""


def platform_backend() -> str:
    """This platform's attention adapter, as the registry's ``backend`` column names it:
    ``"cpu"``, ``"cuda"``, or ``"none"`` (no adapter: budgets are refused, only the
    platform-neutral rows apply). Admission reads the adapter's declared capabilities by this
    name (:data:`obcache_vllm.admission.CAPABILITIES`)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return "none"


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


def _state_problems(module: str, name: str, attrs: tuple[str, ...]) -> list[str]:
    try:
        cls = _resolve(module, name)
    except (ImportError, AttributeError) as exc:
        return [f"{module}.{name}: missing ({exc})"]
    # dataclass fields, msgspec struct fields, or assignments in __init__'s source
    fields = getattr(cls, "__dataclass_fields__", None) or getattr(cls, "__struct_fields__", None)
    source = "" if fields is not None else inspect.getsource(cls.__init__)
    problems = []
    for attr in attrs:
        if fields is not None and attr in fields:
            continue
        if f"self.{attr} =" in source or f"self.{attr}:" in source:
            continue
        if isinstance(getattr(cls, attr, None), property):
            continue
        problems.append(f"{module}.{name}.{attr}: missing")
    return problems


def problems(rows) -> list[str]:
    """One line per row of ``rows`` that does not hold in the installed vLLM."""
    out = signature_problems([(r.module, r.qualname, r.params) for r in rows
                              if r.params is not None and r.how != "absent"])  # fmt: skip
    for row in rows:
        if row.how == "state":
            out += _state_problems(row.module, row.qualname, row.attrs)
        elif row.how == "absent":
            try:
                _resolve(row.module, row.qualname)
            except (ImportError, AttributeError):
                continue
            out.append(f"{row.module}.{row.qualname}: present, and obcache-vllm relies on its "
                       f"absence ({row.why})")
        elif row.params is None:
            try:
                _resolve(row.module, row.qualname)
            except (ImportError, AttributeError) as exc:
                out.append(f"{row.module}.{row.qualname}: missing ({exc})")
    return out


def check_compatibility(include_server: bool = True, backend: str = "cpu") -> None:
    """Raise :class:`IncompatibleVllmError` unless every row for ``backend`` holds.

    ``include_server=False`` skips the API server's rows (``process == "server"``) without
    importing their modules: the check of a process that does not serve the OpenAI API.
    ``backend``: the platform's attention backend (its rows and the ``"any"`` rows).
    """
    import vllm

    if vllm.__version__ not in SUPPORTED_VLLM:
        raise IncompatibleVllmError(
            f"obcache-vllm supports vLLM {', '.join(SUPPORTED_VLLM)}; found {vllm.__version__}"
        )
    rows = [r for r in rows_for(vllm.__version__)
            if r.backend in ("any", backend) and (include_server or r.process != "server")]
    found = problems(rows)
    if found:
        raise IncompatibleVllmError("vLLM internals changed:\n  " + "\n  ".join(found))


# -- installing ---------------------------------------------------------------------------------


def load(path: str) -> Any:
    """The object named ``"package.module:attr.attr"``."""
    module, _, attr = path.partition(":")
    return _resolve(module, attr)


def patch(owner, name: str, wrapper) -> None:
    """Replace ``owner.name`` by ``wrapper(original)`` unless it is already our wrapper.

    Wrappers set ``__obcache_wrapped__ = True`` on the function they return; plugins load once
    per process but ``install`` may run again (tests, several engines), and a double wrap
    would validate or count a request twice.
    """
    current = getattr(owner, name)
    if getattr(current, "__obcache_wrapped__", False):
        return
    setattr(owner, name, wrapper(current))


def _add_field(cls, name: str) -> None:
    """Add ``name: Any = None`` to the dataclass ``cls`` after its creation (idempotent):
    ``__dataclass_fields__`` (what msgspec encodes and decodes), ``__annotations__`` and a
    class-level default (instances built without it read ``None``)."""
    if name in cls.__dataclass_fields__:
        return
    field = dataclasses.field(default=None)
    field.name = name
    field.type = dict[str, Any] | None
    field._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
    cls.__dataclass_fields__[name] = field
    cls.__annotations__[name] = dict[str, Any] | None
    setattr(cls, name, None)


def apply(serving: bool, backend: str, rows: tuple[Seam, ...] = REGISTRY) -> None:
    """Install the :data:`APPLIED` rows of this process, in table order (idempotent).

    ``serving``: this process serves the OpenAI API (its ``server`` rows are installed).
    ``backend``: the platform's attention backend (its rows and the ``"any"`` rows).
    """
    import vllm

    for row in rows_for(vllm.__version__, rows):
        if row.how not in APPLIED or row.backend not in ("any", backend):
            continue
        if row.process == "server" and not serving:
            continue
        *outer, name = row.qualname.split(".")
        owner = _resolve(row.module, ".".join(outer)) if outer else importlib.import_module(
            row.module)
        if row.how == "wrap":
            patch(owner, name, load(row.install))
        elif row.how == "replace":
            setattr(owner, name, load(row.install))
        elif row.how == "field":
            for attr in row.attrs:
                _add_field(getattr(owner, name), attr)
        else:  # backend: vLLM resolves the class path when it builds the backend
            register = _resolve("vllm.v1.attention.backends.registry", "register_backend")
            register(getattr(owner, name), row.install)


_INSTANCE_ROWS = {r.qualname: r for r in REGISTRY if r.how == "instance"}


def bind(instance, qualname: str, new) -> None:
    """Replace the method ``qualname`` (an ``instance`` row) on the one ``instance`` vLLM built.

    Used where vLLM builds the object inside a constructor we do not replace (the KV-cache
    manager, its coordinator and block pool, built by ``Scheduler.__init__``): the class stays
    vLLM's, and other instances are untouched.
    """
    row = _INSTANCE_ROWS.get(qualname)
    if row is None:
        raise ValueError(f"{qualname} is not an instance row of the seam registry")
    if not any(c.__name__ == qualname.split(".")[0] for c in type(instance).__mro__):
        raise TypeError(f"{qualname}: {type(instance).__name__} is not its class")
    setattr(instance, qualname.rsplit(".", 1)[1], new)
