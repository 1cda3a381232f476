"""Admission: a request's kv_* options parsed, resolved, refused or admitted once, up front.

Where each step runs (API-server process; the offline ``LLM``'s own process)::

  HTTP body ─ to_sampling_params (server.py) ─ parse(fields, policy) ─▶ Requested
                                  │  (kv_* fields over the server policy; the one parse)
  rendered prompt ─ AsyncLLM.generate (server.py) ─ admit(Requested, prompt) ─▶ Admitted
                                  │  (resolve, refusals, capacity: a 400 before a stream starts)
  InputProcessor.process_inputs ─ admit_engine_request ─▶ the wire tuple (KvOptions.to_wire)
      (offline LLM, engine API: raw kv_* extra_args and kv_hints are parsed and admitted
      here, in one step)

One type per stage, all in ``extra_args["obcache"]`` while the request is in the front end:
:class:`Requested`, :class:`Admitted`, then the wire tuple EngineCore decodes. Each process
has one entry point: the API server's three wrappers call the three stages in order (each
stage is the next one's only input), and every request of every front end leaves through
:func:`admit_engine_request`, which runs the stages that have not run. The server policy is
passed to :func:`parse`, never stamped on the client's request. This module imports neither
the server nor the stat logger (an import-linter contract): the stat logger hands it its
rejection counter (:func:`count_rejections_with`).
                                  │
  EngineCore (scheduler) and worker: KvOptions.from_wire, never re-validated; a request with
  kv_* fields but no (or a broken) wire form is a counted fault there, never silently stock.

A refusal is a :class:`~obcache_vllm.options.KvOptionsError` naming the field (``kv_budget``
for what the engine cannot do, else the option that cannot be honoured); :func:`rejected` is
the one conversion into vLLM's ``VLLMValidationError`` (HTTP 400), counted by field. Requests
without a budget are never refused for their options: they are stock vLLM requests (only a
pool smaller than the context can make one unservable).

What the engine configuration refuses is decided from data: the generic checks below read
``vllm_config``; the platform's attention-backend adapter and the scheduler-class check are
bound at install time (:func:`bind_platform`), so this module imports no EngineCore or worker class.

Refused with a budget, and why:

================================  ==========================================================
configuration                     why eviction cannot run (or cannot run correctly)
================================  ==========================================================
platform / backend settings       the adapter's own refusals: on CPU a quantized KV cache
                                  other than per-layer-scaled fp8 (fp8, fp8_e4m3, fp8_e5m2
                                  are served); on CUDA those of FLASH_ATTN (see the GPU
                                  settings in the docs), quantized KV caches included; other
                                  platforms: no adapter
speculative decoding with        a decode step verifies several draft tokens and rolls
decode-time eviction (kv_decode,  back the rejected ones: eviction at decode steps was
pressure, sessions, adakv)        measured inexact (one of four kv_decode requests left
                                  greedy's tokens); budgets that evict before decoding
                                  (prompt end, kv_compress_at, prefill chunks) are served
KV connectors / offloading        they assume positional block contents (let through, a
                                  connector that saves a finished request's blocks under
                                  its prompt's hashes gave the next request with that
                                  prompt compacted blocks as its KV: other tokens)
pipeline parallelism              layers (and their compactions) split across stages
state-space hybrid or             KV-cache groups that are not attention (Mamba state), or
attention-free models             none at all
sliding-window models without     vLLM already frees the blocks behind every layer's window
global layers, or with the        (let through: a fault, and other tokens than without a
hybrid KV-cache manager off       budget)
interleaved sliding-window        budgets evict in the global layers (prompt end, compress
models (Gemma 2 and 3): sessions  point, prefill chunks, kv_decode, error targets, adakv,
                                  pressure; CPU only); a session's entry is not built for
                                  several KV-cache groups (a request that reaches the engine
                                  on a layout with no group to evict in is finished with an
                                  error)
V2 model runner                   the eviction path hooks the V1 runner
async scheduling                  orders would be planned on stale state (a step ahead)
``--scheduler-cls`` not ours      EngineCore would build a scheduler that never evicts
KV-sharing layers                 the worker would take a sharing layer (Gemma 3n) for a
                                  layer with a cache of its own and compact the cache it
                                  reads a second time (let through: other tokens than the
                                  HF reference's)
MLA                               latent KV (one compressed head), another cache layout
                                  (let through: a fault, and other tokens than without one)
decode/prefill context parallel   a request's KV is split across ranks
prompt embeddings                 the worker tracks token-id prompts only: let through, the
                                  budget is not applied (a counted fault, nothing evicted)
streaming inputs (``resumable``)  each chunk is scheduled as a new request over the blocks
                                  the last one left: the worker would start it afresh and
                                  attend to the freed head blocks
================================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from obcache_vllm.eviction.sightings import PrefixSightings, auto_point
from obcache_vllm.options import (
    ADMITTED_KEY,
    AUTO,
    KvOptions,
    KvOptionsError,
    KvRequest,
    is_kv_option,
    parse_request,
)
from obcache_vllm.vllm_ext.frontend.capacity import capacity_error

Refusal = Callable[[Any], "str | None"]

# Bound at install time (obcache_vllm.vllm_ext.install): the platform adapter's refusals and
# capabilities, and the check that EngineCore will build a scheduler that evicts.
_bound: dict[str, Any] = {}


def bind_platform(*, platform: Refusal, scheduler: Refusal, capabilities) -> None:
    """Bind what depends on classes of other processes (called by ``install``): the platform
    adapter's refusal and its declared capabilities
    (:class:`~obcache_vllm.vllm_ext.worker.backends.refusals.Capabilities`), and the
    scheduler-class check."""
    _bound["platform"] = platform
    _bound["scheduler"] = scheduler
    _bound["capabilities"] = capabilities


def _capable(name: str) -> bool:
    """Whether the bound platform adapter declares capability ``name`` (none when unbound)."""
    return bool(getattr(_bound.get("capabilities"), name, False))


@dataclass(frozen=True)
class Requested:
    """Stage 1: a request's kv_* options parsed (:func:`parse`), the prompt not known yet.

    Lives in ``extra_args["obcache"]`` between the server's ``to_sampling_params`` and its prompt
    check. ``waived_below``: where the budget is the server policy's (the client asked for
    none), the prompt length under which the policy does not apply and the request is served
    as stock vLLM; None for the client's own budget, which is never waived.
    """

    request: KvRequest
    waived_below: int | None = None


@dataclass(frozen=True)
class Admitted:
    """Stage 2: a request's options after :func:`admit`: resolved, not refused, fitting the pool.

    Lives in ``extra_args["obcache"]`` between the server's prompt check and the input
    processor, which replaces it by the wire tuple (only :func:`admit` makes one, so a client
    cannot send it: a wire tuple or anything else under that key from outside is refused).
    ``request``: what it was resolved from, for the input processor's one late decision (a
    vLLM ``session_id``, known only there: :func:`join_session`).
    """

    options: KvOptions
    request: KvRequest | None = None
    # The budget is the server policy's (the client asked for none): where a later check
    # refuses it, the request is served as stock vLLM instead.
    from_policy: bool = False


# Counts a refusal by field: set by the live Prometheus logger (frontend/stats.py), which
# imports this module; None without one (the offline LLM).
_count_rejection: Callable[[str], None] | None = None


def count_rejections_with(count: Callable[[str], None] | None) -> None:
    """Where :func:`rejected` counts refusals (the stat logger's counter, by field)."""
    global _count_rejection
    _count_rejection = count


def rejected(exc: KvOptionsError):
    """The one conversion of a refusal into vLLM's ``VLLMValidationError`` (HTTP 400), counted
    in ``vllm:obcache_rejected_requests_total`` by field."""
    from vllm.exceptions import VLLMValidationError

    if _count_rejection is not None:
        _count_rejection(exc.field)
    return VLLMValidationError(str(exc), parameter=exc.field, value=exc.shown_value)


def unsupported_reason(vllm_config) -> str | None:
    """Why budgeted requests cannot be served by this engine configuration, or None."""
    platform = _bound.get("platform")
    if platform is None:
        return "obcache-vllm is not installed in this process (no platform adapter bound)"
    reason = platform(vllm_config)
    if reason is not None:
        return reason
    if vllm_config.kv_transfer_config is not None:
        return "KV connectors / offloading are not supported with kv_budget"
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
        return "hybrid state-space / attention-free models are not supported with kv_budget"
    reason = _window_reason(vllm_config)
    if reason is not None:
        return reason
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
    if vllm_config.scheduler_config.async_scheduling:
        return "async scheduling is not supported with kv_budget (--no-async-scheduling)"
    return _bound["scheduler"](vllm_config.scheduler_config)


def interleaved(vllm_config) -> bool:
    """Whether the model interleaves sliding-window and global attention layers (Gemma 2 and
    3): vLLM gives it one KV-cache group of global layers, where budgets evict, and groups of
    sliding-window layers left as stock (:mod:`obcache_vllm.vllm_ext.groups`). A layout the
    engine finds no such group in (the global layers split over several groups, attention
    sinks) finishes a budgeted request with an error there (``StockLayoutScheduler``)."""
    model_config = vllm_config.model_config
    if model_config.get_sliding_window() is None:
        return False
    kinds = set(getattr(model_config.hf_text_config, "layer_types", None) or ())
    return kinds == {"full_attention", "sliding_attention"}


def _window_reason(vllm_config) -> str | None:
    """Why a model with sliding windows cannot take budgets, or None (none, or interleaved with
    global layers, vLLM's hybrid KV-cache manager on, on the CPU backend)."""
    if vllm_config.model_config.get_sliding_window() is None:
        return None
    if not interleaved(vllm_config):
        return ("sliding-window models other than those interleaving sliding-window and global "
                "layers (layer_types) are not supported with kv_budget (vLLM already frees the "
                "blocks behind each layer's window)")  # fmt: skip
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        return ("a sliding-window model with the hybrid KV-cache manager disabled is not "
                "supported with kv_budget (its window and global layers share one group)")
    if not _capable("several_groups"):
        # FLASH_ATTN shifts the batch's sequence lengths in place, and vLLM shares that tensor
        # between the groups: the sliding-window layers would read short rows.
        return ("sliding-window models are supported with kv_budget on vLLM's CPU attention "
                "backend only (not FlashAttention yet)")
    return None


def _hybrid_refusal(vllm_config, options) -> tuple[str, object] | None:
    """(field, value) an interleaved sliding-window model cannot serve yet, or None.

    Budgets evict in such a model's global layers at the prompt's end, at a compress point
    (``kv_compress_at``: the rest of the prompt computed on the compressed cache, but no entry
    left for another request), after every prefill chunk (``kv_prefill_evict``, admitted by
    its bounded peak plus what the sliding-window groups hold) and at decode steps
    (``kv_decode``), to a fixed budget or an error target (its error estimated in the global
    layers), uniform or per head (adakv's own memory in the global layers), always or under
    pressure (the planner counts every group's blocks); its sliding-window layers run as
    stock. Not built for several KV-cache groups: sessions (an entry would need the sliding
    groups' window blocks as well: with this refusal lifted, a session's next turn continues
    nothing). A budgeted request on such a model reads nothing from the prefix cache
    (``PrefixAdapter.enabled``)."""
    if interleaved(vllm_config) and options.session:
        return "kv_session", True
    return None


HYBRID_REFUSAL = ("is not supported on a model with sliding-window layers yet (budgets evict in "
                  "its global layers; a session's continued cache is not built for several "
                  "KV-cache groups)")  # fmt: skip


def _speculative_refusal(vllm_config, options) -> tuple[str, object] | None:
    """(field, value) refused with speculative decoding, or None.

    With speculative decoding a decode step verifies several draft tokens and rolls back the
    rejected ones. A budget whose evictions all happen before decoding starts (at the prompt's
    end, a compress point, prefill chunks) never meets a draft, and greedy requests give the
    tokens they give without drafts (``tests/engine/test_spec_decode.py``). Decode-time
    eviction would score and compact around tokens that may be rolled back; measured with
    ngram drafts it left greedy's tokens (one of four ``kv_decode`` requests, the same test
    with this refusal lifted), so it stays refused: ``kv_decode``, compression under
    pressure (at any step), sessions (an entry left at a decode step) and pipelines whose
    heads own their memory (per-head reads of multi-token decode rows are not tested)."""
    if vllm_config.speculative_config is None:
        return None
    if options.decode:
        return "kv_decode", True
    if options.when == "pressure":
        return "kv_when", options.when
    if options.session:
        return "kv_session", True
    if options.heads_own_memory:
        return "kv_pipeline", options.pipeline
    return None


SPECULATIVE_REFUSAL = ("is not supported with speculative decoding (decode-time eviction is "
                       "not exact under draft rollback); budgets that evict at the prompt's end "
                       "are")  # fmt: skip


def _heads_memory_reason(vllm_config, options) -> str | None:
    """Why a pipeline whose heads own their memory (adakv) cannot run on this engine, or None:
    per-head memory is built for the CPU attention backend on one rank (see the per-head
    memory design: FlashAttention's call and each rank's own counts are not built yet)."""
    if not options.heads_own_memory:
        return None
    name = options.pipeline
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        return (f"{name} is not supported with tensor parallelism yet (each rank would spread "
                "its own KV heads' budget and report its own layout)")  # fmt: skip
    if not _capable("per_head_memory"):
        return (f"{name} needs per-head memory, built for vLLM's CPU attention backend only "
                "(not FlashAttention yet)")  # fmt: skip
    return None


def parse(fields: Mapping[str, Any] | None, policy=None) -> Requested | None:
    """Stage 1, the one parse of a request's kv_* ``fields`` (the client's, or an
    orchestrator's ``kv_hints``): over the server ``policy``'s defaults where one is given
    (:class:`obcache_vllm.config.Policy`; the offline ``LLM`` has none). None: no budget, a
    stock request.

    Raises:
        KvOptionsError: an unknown ``kv_*`` key, or a value out of its domain.
    """
    fields = {k: v for k, v in (fields or {}).items() if is_kv_option(k)}
    if policy is None:
        request = parse_request(fields)
        return None if request is None else Requested(request)
    merged = policy.fields_for(fields)
    from_policy = "kv_budget" not in fields and merged.get("kv_budget") is not None
    request = parse_request(merged)
    if request is None:
        return None
    return Requested(request, policy.min_prompt_tokens if from_policy else None)


_sightings: dict[int, PrefixSightings] = {}  # block size -> this process's index


def sightings(block_size: int) -> PrefixSightings:
    """This process's recently seen prompt prefixes (``kv_compress_at: "auto"``)."""
    index = _sightings.get(block_size)
    if index is None:
        index = _sightings[block_size] = PrefixSightings(block_size)
    return index


def choose_point(vllm_config, request: KvRequest, prompt_token_ids, seed):
    """``(point, continues)`` of a ``kv_compress_at: "auto"`` request (see
    :mod:`obcache_vllm.eviction.sightings`): the compress point (None: its whole prompt) and
    whether it continues a recent prompt (then it is served as ``kv_session``). Records the
    prompt. Without prefix caching nothing is shared: ``(None, False)``."""
    if (
        request.compress_at != AUTO
        or prompt_token_ids is None
        or not vllm_config.cache_config.enable_prefix_caching
        or interleaved(vllm_config)  # no entries on several KV-cache groups: the whole prompt
    ):
        return None, False
    index = sightings(vllm_config.cache_config.block_size)
    seen = index.observe(prompt_token_ids, seed)
    return auto_point(seen.shared, len(prompt_token_ids), seen.point), seen.continues


def admit(
    vllm_config,
    requested: Requested,
    num_prompt_tokens: int,
    *,
    prompt_embeds: bool = False,
    max_tokens: int | None = None,
    prompt_token_ids=None,
    seed=None,
) -> Admitted | None:
    """Stage 2: resolve ``requested`` on its prompt, refuse what this engine cannot serve,
    check it fits.

    ``prompt_embeds``: the prompt carries embeddings (all or some of its positions). ``None``:
    the budget was the server policy's and does not apply (a prompt below its threshold, or a
    request it cannot serve): a stock request, since the client asked for no budget.
    ``prompt_token_ids`` and ``seed`` (its cache salt and LoRA adapter): for
    ``kv_compress_at: "auto"``, which compresses at a prefix shared with recent prompts (none
    given: the whole prompt).

    Raises:
        KvOptionsError: a bad option for this prompt, a refusal, or a request that can never
            fit the KV pool (see :mod:`.capacity`).
    """
    request, threshold = requested.request, requested.waived_below
    if threshold is not None and num_prompt_tokens < threshold:
        return None
    auto = (None, False) if prompt_embeds else choose_point(
        vllm_config, request, prompt_token_ids, seed
    )
    try:
        admitted = _admit(vllm_config, request, num_prompt_tokens, prompt_embeds, max_tokens, auto)
    except KvOptionsError:
        if threshold is not None:
            return None
        raise
    if (
        request.compress_at == AUTO
        and prompt_token_ids is not None
        and not prompt_embeds
        and vllm_config.cache_config.enable_prefix_caching
    ):
        # where it was compressed: the same prompt again compresses there and adopts its entry
        sightings(vllm_config.cache_config.block_size).remember(
            prompt_token_ids, seed, admitted.options.compress_at
        )
    return Admitted(admitted.options, admitted.request, from_policy=threshold is not None)


def _admit(vllm_config, request, num_prompt_tokens, prompt_embeds, max_tokens, auto) -> Admitted:
    max_len = vllm_config.model_config.max_model_len
    point, continues = auto
    # Where the engine refuses sessions, "auto" must not start one the client never asked for.
    sessions = (
        vllm_config.cache_config.enable_prefix_caching
        and getattr(vllm_config, "speculative_config", None) is None
        and not interleaved(vllm_config)
    )
    options = request.resolve(num_prompt_tokens, max_len, auto_point=point,
                              auto_session=continues, sessions=bool(sessions))  # fmt: skip
    reason = unsupported_reason(vllm_config)
    if reason is not None:
        raise KvOptionsError("kv_budget", reason, options.budget)
    if prompt_embeds:
        raise KvOptionsError(
            "kv_budget",
            "not supported for requests with prompt embeddings (prompt_embeds)",
            options.budget,
        )
    if options.max_error is not None and vllm_config.parallel_config.tensor_parallel_size > 1:
        raise KvOptionsError(
            "kv_budget",
            "an error target is not supported with tensor parallelism yet (each rank would "
            "choose from its own KV heads)",
            options.requested_budget,
        )
    reason = _heads_memory_reason(vllm_config, options)
    if reason is not None:
        raise KvOptionsError("kv_pipeline", reason, options.pipeline)
    speculative = _speculative_refusal(vllm_config, options)
    if speculative is not None:
        field, value = speculative
        raise KvOptionsError(field, f"{field} {SPECULATIVE_REFUSAL}", value)
    hybrid = _hybrid_refusal(vllm_config, options)
    if hybrid is not None:
        field, value = hybrid
        raise KvOptionsError(field, f"{field} {HYBRID_REFUSAL}", value)
    if options.session and not vllm_config.cache_config.enable_prefix_caching:
        raise KvOptionsError(
            "kv_session",
            "needs prefix caching (the continued cache lives in vLLM's prefix cache); the "
            "server runs with --no-enable-prefix-caching",
            True,
        )
    check_fits(vllm_config, num_prompt_tokens, max_tokens, options)
    return Admitted(options, request)


def join_session(vllm_config, admitted: Admitted, engine_request) -> Admitted:
    """The request carries vLLM's ``session_id`` (its body, the ``X-Session-ID`` header or
    ``vllm_xargs``; vLLM resolves them onto the engine request): it takes part in that session,
    as ``kv_session`` would (its entry is found by its tokens, so a turn continues the cache
    its session's last turn left), where its options allow one
    (:meth:`~obcache_vllm.options.KvRequest.joins_session`) and prefix caching is on. A
    request the session would not fit keeps its own options."""
    session_id = getattr(engine_request, "session_id", None)
    request = admitted.request
    if (
        not session_id
        or request is None
        or admitted.options.session
        or not request.joins_session()
        or not vllm_config.cache_config.enable_prefix_caching
        or vllm_config.speculative_config is not None  # a session is refused with drafts
        or interleaved(vllm_config)  # so is a session on sliding-window layers
    ):
        return admitted
    from vllm.utils import length_from_prompt_token_ids_or_embeds

    num_prompt = length_from_prompt_token_ids_or_embeds(
        engine_request.prompt_token_ids, engine_request.prompt_embeds
    )
    max_len = vllm_config.model_config.max_model_len
    try:
        options = request.resolve(num_prompt, max_len, session_id=session_id)
        check_fits(vllm_config, num_prompt, engine_request.sampling_params.max_tokens, options)
    except KvOptionsError:
        return admitted
    return Admitted(options, request, admitted.from_policy)


def check_fits(vllm_config, num_prompt_tokens: int, max_tokens, options) -> None:
    """Raise the :func:`~.capacity.capacity_error` of a request that can never fit the pool."""
    error = capacity_error(vllm_config, num_prompt_tokens, max_tokens, options)
    if error is not None:
        raise error


# The kv_hints action that carries kv_* options (vLLM's KvHintsEnvelope, v1/kv_hints/protocol.py):
# an orchestrator that drives the engine API sets a request's budget or session with it.
HINT_ACTION_TYPE = "obcache.kv_options"
HINT_ACTION_VERSION = "1"


def hinted_fields(kv_hints) -> dict[str, Any]:
    """The kv_* fields of a request's ``kv_hints`` envelope: the payload of its
    ``obcache.kv_options`` action (version ``1``; other actions are other components'), or
    ``{}``. The payload holds request fields by their wire names (``{"kv_budget": 0.25}``).

    Raises:
        KvOptionsError: field ``kv_hints``: more than one such action, another version, a
            payload that is not an object of kv_* fields, or a field outside the option set.
    """
    actions = [a for a in (getattr(kv_hints, "actions", None) or ())
               if getattr(a, "action_type", None) == HINT_ACTION_TYPE]  # fmt: skip
    if not actions:
        return {}
    if len(actions) > 1:
        raise KvOptionsError("kv_hints", f"more than one {HINT_ACTION_TYPE} action", len(actions))
    action = actions[0]
    if action.action_version != HINT_ACTION_VERSION:
        raise KvOptionsError(
            "kv_hints",
            f"{HINT_ACTION_TYPE} version {action.action_version!r} is not supported "
            f"(supported: {HINT_ACTION_VERSION!r})",
            action.action_version,
        )
    payload = action.payload
    if not isinstance(payload, Mapping):
        raise KvOptionsError("kv_hints", f"{HINT_ACTION_TYPE} payload must be an object", payload)
    bad = sorted(k for k in payload if not isinstance(k, str) or not is_kv_option(k))
    if bad:
        raise KvOptionsError(
            "kv_hints", f"{HINT_ACTION_TYPE} payload holds kv_* fields only, not {bad[0]!r}",
            bad[0],
        )  # fmt: skip
    return dict(payload)


def admit_engine_request(vllm_config, engine_request) -> None:
    """The input processor's step: the request leaves the front end with its wire form.

    * :class:`Admitted` (the server admitted it on the rendered prompt): encoded as is, or
      joined to the vLLM ``session_id`` the request carries (:func:`join_session`).
    * :class:`Requested` (parsed by the server, not admitted yet): admitted here.
    * raw ``kv_*`` extra_args (offline ``LLM``, the engine API): parsed and admitted here.
    * anything else under the reserved key: refused.
    * no options: a stock request; only the pool's size can refuse it.

    The engine API's ``kv_hints`` (:func:`hinted_fields`) give a request kv_* fields an
    orchestrator chose: the request's own kv_* ``extra_args`` win field by field, the hint
    fills in the rest (a request the server already parsed or admitted keeps its own).

    The request's ``sampling_params`` is the input processor's own copy: its ``extra_args``
    is replaced, never mutated (the caller's params may be shared across prompts).

    Raises:
        vllm.exceptions.VLLMValidationError: through :func:`rejected`.
    """
    params = engine_request.sampling_params
    if params is None:
        return
    extra = params.extra_args or {}
    value = extra.get(ADMITTED_KEY)
    try:
        hints = hinted_fields(getattr(engine_request, "kv_hints", None)) if value is None else {}
    except KvOptionsError as exc:
        raise rejected(exc) from exc
    has_fields = any(is_kv_option(k) for k in extra) or bool(hints)
    if value is None and not has_fields:
        if pool_is_short(vllm_config):
            _check_unbudgeted(vllm_config, engine_request)
        return
    from vllm.utils import length_from_prompt_token_ids_or_embeds

    embeds = engine_request.prompt_embeds
    num_prompt = length_from_prompt_token_ids_or_embeds(engine_request.prompt_token_ids, embeds)
    try:
        if isinstance(value, Admitted):
            admitted = value
        elif value is not None and not isinstance(value, Requested):
            raise KvOptionsError(ADMITTED_KEY, "is reserved for obcache-vllm's admission", value)
        else:
            own = {k: v for k, v in extra.items() if is_kv_option(k)}
            requested = value if value is not None else parse({**hints, **own})
            if requested is None:  # "kv_budget": null: a stock request, its fields dropped
                kept = {k: v for k, v in extra.items() if not is_kv_option(k)}
                params.extra_args = kept or None
                return
            admitted = admit(
                vllm_config,
                requested,
                num_prompt,
                prompt_embeds=embeds is not None,
                max_tokens=params.max_tokens,
                prompt_token_ids=engine_request.prompt_token_ids,
                seed=prompt_seed(engine_request.cache_salt, engine_request.lora_request),
            )
    except KvOptionsError as exc:
        raise rejected(exc) from exc
    rest = {k: v for k, v in extra.items() if not is_kv_option(k) and k != ADMITTED_KEY}
    if admitted is None:  # the policy's budget does not apply: a stock request
        params.extra_args = rest or None
        return
    if getattr(engine_request, "resumable", False):
        if admitted.from_policy:  # the client asked for no budget: a stock request
            params.extra_args = rest or None
            return
        raise rejected(KvOptionsError("kv_budget", STREAMING_REFUSAL, admitted.options.budget))
    if embeds is None:
        admitted = join_session(vllm_config, admitted, engine_request)
    params.extra_args = {**rest, ADMITTED_KEY: admitted.options.to_wire()}


# Why a streaming-input request (vLLM's ``StreamingInput``, ``resumable``) gets no budget.
STREAMING_REFUSAL = (
    "not supported for streaming-input requests: vLLM schedules each input chunk as a new "
    "request over the blocks the last one left, which a compressed cache (its head blocks "
    "returned to the pool) cannot be continued from yet"
)


def prompt_seed(cache_salt, lora_request):
    """What besides its tokens decides whether two prompts may share KV (the sightings'
    seed): the cache salt and the LoRA adapter, as in vLLM's block hashes."""
    return (cache_salt, getattr(lora_request, "lora_name", None))


def pool_is_short(vllm_config) -> bool:
    """Whether the pool holds less than one request of ``max_model_len`` tokens (only then
    can a stock request be too big for it; vLLM's length checks cover the rest)."""
    from obcache_vllm.vllm_ext.frontend.capacity import pool_blocks

    usable = pool_blocks(vllm_config)
    if usable is None:
        return False
    bs = vllm_config.cache_config.block_size
    return usable * bs < vllm_config.model_config.max_model_len


def _check_unbudgeted(vllm_config, engine_request) -> None:
    from vllm.utils import length_from_prompt_token_ids_or_embeds

    try:
        num_prompt = length_from_prompt_token_ids_or_embeds(
            engine_request.prompt_token_ids, engine_request.prompt_embeds
        )
    except ValueError:
        return  # no prompt to hold
    try:
        check_fits(vllm_config, num_prompt, engine_request.sampling_params.max_tokens, None)
    except KvOptionsError as exc:
        raise rejected(exc) from exc
