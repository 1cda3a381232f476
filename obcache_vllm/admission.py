"""Admission: why a request is refused, and with which defaults, in one place.

Every decision obcache-vllm makes about a request before it reaches EngineCore is a function
of this module: the server policy's defaults and their merge with the request's own fields,
the option combinations a request cannot have, its resolution on a prompt (budget in tokens,
compress point, sessions), what the engine configuration and the platform's attention
backend refuse, and whether the request can ever fit the KV pool. Plain Python (no vLLM
import: it reads the engine configuration's attributes), so the HF reference, the config
loader and the tests call the same rules the server runs. The vLLM seams that call it, and
turn a refusal into vLLM's HTTP 400, are :mod:`obcache_vllm.vllm_ext.frontend.intake`
(the input processor, every front end) and :mod:`obcache_vllm.vllm_ext.frontend.server`
(the OpenAI server).

A request's way through (each step a function here)::

  kv_* fields ── parse(fields, policy) ──────────────▶ Requested   (values, combinations,
                 (option table parsers, merge_fields,                 the server's defaults)
                  refuse_options)
  Requested ─── Admission.admit(prompt) ─────────────▶ Admitted    (resolved on the prompt,
                 (choose_point, resolve, engine_refusal,              refused or fitted)
                  request_refusal, capacity_error)
  Admitted ──── Admission.join_session(session_id) ──▶ Admitted    (vLLM's session_id)
             ── KvOptions.to_wire ──▶ extra_args["obcache"], decoded by EngineCore and the worker

Which defaults: a request's own ``kv_*`` fields, over the server policy where one applies
(:class:`Policy`, loaded by :func:`obcache_vllm.config.load_policy` from the packaged
``default.yaml``, ``$OBCACHE_VLLM_CONFIG`` and ``OBCACHE_KV_*``; :func:`merge_fields`), over
the option table's own defaults (:data:`obcache_vllm.options.OPTIONS`: the offline ``LLM``
and the engine API, which have no policy). A budget that came from the policy is waived, not
refused, where it cannot be served (the client asked for none).

Why refused: a :class:`~obcache_vllm.options.KvOptionsError` naming the field. The value
domains of single fields are the option table's parsers (:mod:`obcache_vllm.options`); every
other refusal is raised here (``tests/unit/test_admission_rules.py`` finds every refusal the
package makes and checks it is one of these). Requests without a budget are never refused for
their options: they are stock vLLM requests (only a pool smaller than the context can make one
unservable).

Refused with a budget, by engine configuration (:func:`engine_refusal`), and why:

================================  ==========================================================
configuration                     why eviction cannot run (or cannot run correctly)
================================  ==========================================================
platform / backend settings       what the platform's adapter declares it cannot serve
                                  (:data:`CAPABILITIES`): on CPU a quantized KV cache
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

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from obcache_vllm import options
from obcache_vllm.eviction.planning import peak_blocks
from obcache_vllm.eviction.sightings import PrefixSightings, auto_point
from obcache_vllm.options import (
    AUTO,
    FIRST_POINT,
    ErrorTarget,
    KvOptions,
    KvOptionsError,
    KvRequest,
    bounded,
    is_error_target,
    is_kv_option,
)

# ============================================================================================
# 1. What each platform's attention adapter declares it serves
# ============================================================================================

# vLLM --kv-cache-dtype values whose values a float cache holds (no quantization).
FLOAT_KV_DTYPES = ("auto", "bfloat16", "float16", "float32")
# Quantized KV dtypes the CPU adapter reads: fp8 bytes with one scale per layer for keys and
# one for values (obcache_vllm/eviction/quantized.py). Not fp8_per_token_head (scales per
# token and head, stored beside the cache) nor fp8_inc / fp8_ds_mla (other layouts).
CPU_FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class Capabilities:
    """What a platform's attention adapter serves, declared once (its class reads its row,
    admission reads the platform's; neither decides by device type).

    ``adapter``: the vLLM attention backend the adapter extends (None: no adapter, every
    budget is refused). ``quantized_kv``: the quantized ``--kv-cache-dtype`` values it reads
    (float caches always). ``per_head_memory``: a pipeline whose KV heads own their memory
    (adakv) can run (the adapter implements ``head_reads`` / ``attend_per_head``).
    ``several_groups``: budgets on a model with several KV-cache groups (Gemma 2 and 3: a
    global group evicts, sliding-window groups run as stock); FlashAttention shifts the
    batch's sequence lengths in place, in a tensor vLLM shares between the groups, so it
    cannot. The rest are what FLASH_ATTN's paged view cannot serve (see
    :mod:`obcache_vllm.vllm_ext.worker.backends.flash_attn`): ``chosen_backend`` (vLLM picks
    the backend in the worker, after admission, so it must be named), ``kernel_block_multiple``
    (its kernel's block sizes), ``full_cudagraphs``, ``micro_batching`` (dual-batch overlap),
    ``alibi`` and ``prefix_lm_masks`` (prefix-LM / R-SWA attention masks).
    """

    adapter: str | None
    quantized_kv: tuple[str, ...] = ()
    per_head_memory: bool = False
    several_groups: bool = False
    chosen_backend: bool = False
    kernel_block_multiple: int = 1
    full_cudagraphs: bool = True
    micro_batching: bool = True
    alibi: bool = True
    prefix_lm_masks: bool = True


# By seam-registry backend name (``seams.platform_backend``: "cpu", "cuda", "none").
CAPABILITIES: dict[str, Capabilities] = {
    "cpu": Capabilities("CPU_ATTN", quantized_kv=CPU_FP8_KV_DTYPES, per_head_memory=True,
                        several_groups=True),  # fmt: skip
    "cuda": Capabilities("FLASH_ATTN", chosen_backend=True, kernel_block_multiple=16,
                         full_cudagraphs=False, micro_batching=False, alibi=False,
                         prefix_lm_masks=False),  # fmt: skip
    "none": Capabilities(None),
}


def platform_refusal(vllm_config, capabilities: Capabilities) -> str | None:
    """Why the platform's adapter cannot serve budgets on this configuration, or None."""
    caps = capabilities
    if caps.adapter is None:
        return "KV eviction is implemented for vLLM's CPU and CUDA (FLASH_ATTN) backends only"
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in FLOAT_KV_DTYPES and cache_dtype not in caps.quantized_kv:
        also = f"; {', '.join(caps.quantized_kv)} are" if caps.quantized_kv else ""
        return (f"quantized KV cache ({cache_dtype}) is not supported with kv_budget on this "
                f"backend (float KV caches{also} served)")  # fmt: skip
    if caps.chosen_backend:
        attention = vllm_config.attention_config
        backend = getattr(attention.backend, "name", attention.backend)
        if backend != caps.adapter or getattr(attention, "backend_per_kind", None):
            return (f"kv_budget on CUDA needs --attention-backend {caps.adapter} (the automatic "
                    "choice is made in the worker, after this check)")  # fmt: skip
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if not caps.full_cudagraphs and mode is not None and mode.has_full_cudagraphs():
        return (f"kv_budget is not supported with full CUDA graphs (cudagraph_mode={mode.name}): "
                "use -cc.cudagraph_mode=PIECEWISE or --enforce-eager")  # fmt: skip
    block_size = vllm_config.cache_config.block_size
    multiple = caps.kernel_block_multiple
    if block_size is not None and block_size % multiple:
        return (f"kv_budget on {caps.adapter} needs a block size multiple of {multiple}, got "
                f"{block_size}")  # fmt: skip
    if not caps.micro_batching and getattr(vllm_config.parallel_config, "enable_dbo", False):
        return "dual-batch overlap (micro-batching) is not supported with kv_budget"
    model = vllm_config.model_config
    text = getattr(model, "hf_text_config", None)
    if not caps.alibi and (
        getattr(text, "alibi", False) or getattr(text, "position_embedding_type", "") == "alibi"
    ):
        return f"ALiBi models are not supported with kv_budget on {caps.adapter}"
    if not caps.prefix_lm_masks and (
        getattr(model, "is_mm_prefix_lm", False) or getattr(model, "rswa_window", None)
    ):
        return "prefix-LM / R-SWA attention masks are not supported with kv_budget"
    return None


# ============================================================================================
# 2. Which defaults: the server policy
# ============================================================================================


MIN_PROMPT_KEY = "min_prompt_tokens"  # the policy's key: the default budget's smallest prompt
COMPRESS_AT_KEY = "compress_at"  # the policy's key: where the default budget compresses
# The policy's key: the selection a query-agnostic request gets (see merge_fields).
QUERY_AGNOSTIC_KEY = "query_agnostic"
# The fields that make one selection: measured (and so defaulted per traffic) as a whole.
SELECTION_FIELDS = ("kv_scorer", "kv_pipeline", "kv_window", "kv_per_head")


@dataclass(frozen=True)
class Policy:
    """The server's kv_* defaults and when they apply (loaded and validated by
    :func:`obcache_vllm.config.load_policy`; the offline ``LLM`` has none).

    ``defaults``: every request field's default (``None``: no default). ``min_prompt_tokens``:
    the default budget applies to prompts of at least this many tokens. ``compress_at``:
    where the default budget compresses (``"auto"``: the prefix the prompt shares with recent
    prompts; None: the whole prompt). ``query_agnostic``: the selection (some of
    :data:`SELECTION_FIELDS`) a query-agnostic request gets instead of the defaults' (see
    :func:`merge_fields`); None: the defaults' for every request.
    """

    defaults: dict[str, Any]
    min_prompt_tokens: int = 0
    compress_at: str | None = AUTO
    query_agnostic: dict[str, Any] | None = None

    def document(self) -> dict[str, Any]:
        return {
            "defaults": dict(self.defaults),
            MIN_PROMPT_KEY: self.min_prompt_tokens,
            COMPRESS_AT_KEY: self.compress_at,
            QUERY_AGNOSTIC_KEY: None if self.query_agnostic is None else dict(self.query_agnostic),
        }


def is_query_agnostic(requested: Mapping[str, Any]) -> bool:
    """Whether a request's own fields say its prompt is compressed before its question: a
    ``kv_compress_at`` at a position, as the option's parser reads one (``512``, ``512.0``,
    ``-96``; ``"auto"`` decides later, from what the server has seen, and compresses a prompt
    it has not seen nearly whole). A value the parser refuses is not: its refusal names it."""
    point = requested.get("kv_compress_at")
    if point is None or point == AUTO:
        return False
    try:
        return isinstance(options.point("kv_compress_at", point), int)
    except KvOptionsError:
        return False


def merge_fields(
    defaults: Mapping[str, Any],
    requested: Mapping[str, Any],
    query_agnostic: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The kv_* options of one request: its own fields over the server defaults.

    ``requested`` holds the request's kv_* fields (``vllm_xargs`` and top-level, already merged).
    A request whose budget (its own, else the default) is ``None`` gets no defaults: it stays a
    stock request, and any other kv_* field it set is reported by validation as needing a
    budget. ``"kv_budget": null`` in a request therefore opts out of a default budget.

    ``query_agnostic`` (the policy's): the selection a request gets in place of the defaults'
    when it is query-agnostic (:func:`is_query_agnostic`) and names none of
    :data:`SELECTION_FIELDS`. A selection was measured whole (``make choose-defaults``'s
    query-agnostic traffic, where the query-aware winner kept fewer needles than ``random``),
    so a request that names part of one gets the ordinary defaults for the rest.
    """
    budget = requested["kv_budget"] if "kv_budget" in requested else defaults.get("kv_budget")
    if budget is None:
        return {k: v for k, v in requested.items() if k != "kv_budget"}
    merged = {k: v for k, v in defaults.items() if v is not None}
    if (query_agnostic and is_query_agnostic(requested)
            and not any(f in requested for f in SELECTION_FIELDS)):  # fmt: skip
        merged.update(query_agnostic)
    merged.update(requested)
    merged["kv_budget"] = budget
    return merged


def policy_fields(policy: Policy, requested: Mapping[str, Any]) -> dict[str, Any]:
    """The kv_* options of one request under ``policy`` (:func:`merge_fields`, then the
    policy's compress point where its budget applies and the options allow one: not for an
    error target, which compresses the whole prompt, nor with a session, prefill chunks or
    pressure)."""
    merged = merge_fields(policy.defaults, requested, policy.query_agnostic)
    if (
        policy.compress_at is not None
        and "kv_budget" not in requested
        and merged.get("kv_budget") is not None
        and not is_error_target(merged["kv_budget"])
        and merged.get("kv_compress_at") is None
        and not merged.get("kv_session")
        and not merged.get("kv_prefill_evict")
        and merged.get("kv_when", "always") == "always"
    ):
        merged["kv_compress_at"] = policy.compress_at
    return merged


# ============================================================================================
# 3. Option combinations a request cannot have (its prompt not known yet)
# ============================================================================================


def _pipeline(name: str):
    from obcache_vllm.scoring import pipeline_class

    return pipeline_class(name)


def sums_every_query(pipeline: str) -> bool:
    """Whether the pipeline keeps running sums over every query (h2o): they cannot travel
    with a continued cache, nor start late."""
    return _pipeline(pipeline).sums_every_query


def continues(pipeline: str) -> bool:
    """Whether its cache can be continued (``kv_session``) or start late (``kv_when``
    "pressure"): its state lives in the cache, laid out as every pipeline's."""
    pipe = _pipeline(pipeline)
    return not pipe.sums_every_query and not pipe.heads_own_memory


def _without_running_sums() -> str:
    from obcache_vllm.scoring import pipeline_names

    names = [n for n in pipeline_names() if continues(n)]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def _refuse_session(request: KvRequest) -> None:
    """What a continued cache cannot carry (see ``kv_session``)."""
    if not request.session:
        return
    if sums_every_query(request.pipeline):
        raise KvOptionsError(
            "kv_session",
            f"not supported with kv_pipeline {request.pipeline}: its running sums of every "
            f"query would have to travel with the cache; use {_without_running_sums()}",
            True,
        )
    for name, value in (("kv_compress_at", request.compress_at),
                        ("kv_prefill_evict", request.prefill_evict or None)):  # fmt: skip
        if value is not None:
            raise KvOptionsError(
                "kv_session", f"cannot be combined with {name} (a session compresses at the "
                "end of each prompt)", True,
            )  # fmt: skip


def _refuse_pressure(request: KvRequest) -> None:
    """What compression under pressure cannot do (see ``kv_when``)."""
    if request.when != "pressure":
        return
    if sums_every_query(request.pipeline):
        raise KvOptionsError(
            "kv_when",
            f'"pressure" is not supported with kv_pipeline {request.pipeline}: it would have '
            f"to score every query all along; use {_without_running_sums()}",
            "pressure",
        )
    for name, value in (("kv_compress_at", request.compress_at),
                        ("kv_prefill_evict", request.prefill_evict or None),
                        ("kv_session", request.session or None)):  # fmt: skip
        if value is not None:
            raise KvOptionsError(
                "kv_when", f'"pressure" cannot be combined with {name}', "pressure"
            )


def _refuse_heads_memory(request: KvRequest) -> None:
    """What a pipeline whose heads own their memory (adakv) cannot do yet: its per-head layout
    is read and rewritten at the compress point, by decode-time orders and by a session's
    next turn only (see ``kv_pipeline``)."""
    if not _pipeline(request.pipeline).heads_own_memory:
        return
    budget = request.budget
    for name, value, why in (
        ("kv_prefill_evict", request.prefill_evict or None, "an eviction per prefill chunk"),
        ("kv_when", None if request.when == "always" else request.when,
         "an eviction under pressure"),
        ("kv_budget", budget.scalar() if isinstance(budget, ErrorTarget) else None,
         "an error target"),
    ):  # fmt: skip
        if value is not None:
            raise KvOptionsError(
                name, f"not supported with kv_pipeline {request.pipeline} yet: {why} would "
                "have to read or rewrite its per-head layout (see the per-head memory design)",
                value,
            )  # fmt: skip


def _check_room(budget: int, sinks: int, recent: int) -> None:
    if sinks + recent >= budget:
        raise KvOptionsError(
            "kv_budget",
            f"budget {budget} must exceed kv_sinks + kv_recent = {sinks + recent}",
            budget,
        )


def _refuse_target(request: KvRequest) -> None:
    """An error target reads the window queries' outputs (or, for h2o, a score that is a share
    of attention), at one eviction at the end of the prompt (see
    :mod:`obcache_vllm.scoring.estimate`)."""
    from obcache_vllm.scoring import make_scorer

    pipeline = _pipeline(request.pipeline)
    why = None
    if not pipeline.scored:
        why = f"kv_pipeline {request.pipeline} has no scored queries to measure the error with"
    elif pipeline.sums_every_query and not make_scorer(request.scorer).attention_share:
        why = (f"kv_scorer {request.scorer} with kv_pipeline {request.pipeline}: with no window "
               "of queries kept, the error is the share of attention evicted, which needs "
               "kv_scorer attn or value_norm (or use snapkv or tova)")  # fmt: skip
    else:
        for name, value in (("kv_prefill_evict", request.prefill_evict or None),
                            ("kv_when", None if request.when == "always" else request.when)):
            if value is not None:  # fmt: skip
                why = f"cannot be combined with {name} yet (one eviction at the prompt's end)"
                break
    if why is None and request.budget.kl:
        why = _kl_target_refusal(request)
    if why is not None:
        kind = "a KL target" if request.budget.kl else "an error target"
        raise KvOptionsError("kv_budget", f"{kind}: {why}", request.budget.scalar())


def _kl_target_refusal(request: KvRequest) -> str | None:
    """What a KL target (``{"max_kl": nats}``) cannot be combined with: its calibration maps a
    whole prompt's compression at its end, with no eviction after it, to the KL of the tokens
    that follow (:mod:`obcache_vllm.scoring.calibration`); a window pipeline's errors only."""
    if sums_every_query(request.pipeline):
        return (f"kv_pipeline {request.pipeline} has no window of queries, whose outputs' "
                "errors a KL calibration maps (use snapkv or tova)")  # fmt: skip
    for name, value in (("kv_compress_at", request.compress_at),
                        ("kv_session", request.session or None),
                        ("kv_decode", request.decode or None)):  # fmt: skip
        if value is not None:
            return (f"cannot be combined with {name} yet (its calibration measured a whole "
                    "prompt compressed at its end, nothing evicted after)")  # fmt: skip
    return None


def refuse_options(request: KvRequest) -> None:
    """Every combination of a request's own options it cannot have, in the table's order:
    a budget that leaves no room beyond the sinks and recent tokens (a fraction is checked
    when it is resolved on a prompt), what an error target cannot serve, what adakv's per-head
    layout cannot serve yet, what a session cannot carry, what compression under pressure
    cannot do.

    Raises:
        KvOptionsError: naming the field that cannot be honoured.
    """
    budget = request.budget
    if isinstance(budget, ErrorTarget):
        _refuse_target(request)
        if isinstance(budget.floor, int):
            _check_room(budget.floor, request.sinks, request.recent)
    elif isinstance(budget, int):
        _check_room(budget, request.sinks, request.recent)
    _refuse_heads_memory(request)
    _refuse_session(request)
    _refuse_pressure(request)


def parse_request(raw: Mapping[str, Any] | None) -> KvRequest | None:
    """The one parse of a request's kv_* fields: every value in its domain (the option
    table's parsers), then :func:`refuse_options`. ``None``: no budget, a stock request.

    Raises:
        KvOptionsError: an unknown ``kv_*`` key, a value out of its domain, or a combination
            of options the request cannot have.
    """
    request = options.TABLE.parse_request(raw)
    if request is not None:
        refuse_options(request)
    return request


def parse_kv_options(
    extra_args: Mapping[str, Any] | None,
    num_prompt_tokens: int,
    max_model_len: int | None = None,
) -> KvOptions | None:
    """:func:`parse_request` then :func:`resolve`: one request's options, or None.

    For callers that hold the fields and the prompt together (the HF reference, the server
    config's validation, tests); a served request takes the two steps at the front end.
    """
    request = parse_request(extra_args)
    return None if request is None else resolve(request, num_prompt_tokens, max_model_len)


# ============================================================================================
# 4. Resolution on a prompt: the budget in tokens, the compress point, sessions
# ============================================================================================


def joins_session(request: KvRequest) -> bool:
    """Whether a vLLM ``session_id`` on this request makes it a ``kv_session`` request:
    where its options allow a session (no position of its own in ``kv_compress_at``, no
    ``kv_prefill_evict``, ``kv_when: always``, a pipeline whose state fits in the cache).
    Elsewhere the id is vLLM's alone (routing, KV events) and the options stand: an
    error target among them (it takes ``kv_session: true`` explicitly, each turn choosing
    within what the earlier turns left of the target; the id, and ``"auto"``'s
    tentative sessions, stay out of it)."""
    return (
        not request.session
        and request.compress_at in (None, AUTO)
        and not request.prefill_evict
        and request.when == "always"
        and not isinstance(request.budget, ErrorTarget)
        and not sums_every_query(request.pipeline)
    )


def _room_at(request: KvRequest, at: int) -> bool:
    """Whether compressing the first ``at`` tokens to this budget leaves room beyond the sinks
    and recent tokens and evicts something."""
    tokens = request.budget
    if isinstance(tokens, ErrorTarget):
        return False  # "auto" chooses no point for a target: it compresses whole
    if not isinstance(tokens, int):
        tokens = max(1, math.ceil(tokens * at))
    return request.sinks + request.recent < tokens < at


def resolve(
    request: KvRequest,
    num_prompt_tokens: int,
    max_model_len: int | None = None,
    auto_point: int | None = None,
    auto_session: bool = False,
    session_id: str | None = None,
    sessions: bool = True,
) -> KvOptions:
    """The options of ``request`` on a prompt of ``num_prompt_tokens`` tokens.

    ``auto_point``: for ``kv_compress_at: "auto"``, the point the front end chose from the
    prompts it has seen (None: the whole prompt); taken only where its budget leaves room
    beyond the sinks and recent tokens, else the whole prompt. ``auto_session``: the prompt
    continues a recent one (a chat's next turn): it is served as ``kv_session`` instead,
    where its options allow a session (:func:`joins_session`). A whole-prompt ``"auto"``
    request whose options allow one is a *tentative* session (``KvOptions.tentative``):
    it may be a chat's first turn, so its final cache is left for a next turn, held only
    while the pool has room to spare. ``session_id``: vLLM's own session id of the
    request (body, ``X-Session-ID`` header or ``vllm_xargs``): the request takes part in
    that session, as with ``kv_session`` (see :func:`joins_session`). ``sessions``: whether
    the engine serves sessions at all (prefix caching on, no speculative decoding, one
    KV-cache group to evict in); without, ``"auto"`` never starts one: it compresses at the
    point it chose, else the whole prompt, instead of a session the engine would refuse.

    Raises:
        KvOptionsError: ``kv_compress_at`` past the prompt, a budget or window beyond the
            context, or a budget that leaves no room beyond the sinks and recent tokens.
    """
    if session_id and joins_session(request):
        joined = dataclasses.replace(request, compress_at=None, session=True)
        return resolve(joined, num_prompt_tokens, max_model_len)
    if request.compress_at == AUTO:
        return _resolve_auto(request, num_prompt_tokens, max_model_len, auto_point,
                             auto_session, sessions)  # fmt: skip
    at = request.compress_at
    if at is not None and at < 0:
        if num_prompt_tokens + at < 1:
            raise KvOptionsError(
                "kv_compress_at",
                f"{at} reaches before the start of a {num_prompt_tokens}-token prompt",
                at,
            )
        at = num_prompt_tokens + at
    if at is not None and at > num_prompt_tokens:
        raise KvOptionsError(
            "kv_compress_at", f"{at} exceeds the prompt length {num_prompt_tokens}", at
        )
    base = at or num_prompt_tokens
    tokens, requested, max_error, kl = request.budget, request.budget, None, False
    if isinstance(tokens, ErrorTarget):
        requested, max_error, kl = tokens.scalar(), tokens.max_error, tokens.kl
        tokens = tokens.floor or request.sinks + request.recent + 1
    if not isinstance(tokens, int):
        tokens = max(1, math.ceil(tokens * base))
    if max_model_len is not None and tokens > max_model_len:
        raise KvOptionsError(
            "kv_budget", f"{bounded(tokens)} exceeds the model context length {max_model_len}",
            tokens,
        )  # fmt: skip
    if max_model_len is not None and request.window > max_model_len:
        raise KvOptionsError(
            "kv_window",
            f"{bounded(request.window)} exceeds the model context length {max_model_len}",
            request.window,
        )
    _check_room(tokens, request.sinks, request.recent)
    return request.options(budget=tokens, compress_at=at, requested_budget=requested,
                           max_error=max_error, kl_target=kl)  # fmt: skip


def _resolve_auto(request, num_prompt_tokens, max_model_len, auto_point, auto_session,
                  sessions) -> KvOptions:  # fmt: skip
    """``kv_compress_at: "auto"`` (see :func:`resolve`)."""
    resumable = sessions and continues(request.pipeline)
    # An error target's session is asked for explicitly (``kv_session``), never started by a
    # continuation "auto" noticed (see joins_session).
    if auto_session and resumable and not isinstance(request.budget, ErrorTarget):
        continued = dataclasses.replace(request, compress_at=None, session=True)
        return resolve(continued, num_prompt_tokens, max_model_len)
    at = auto_point
    if at is not None and (
        at >= num_prompt_tokens or not _room_at(request, at) or not continues(request.pipeline)
    ):  # a point is worth compressing at only where the cache becomes an entry
        at = None
    if at is None and resumable and joins_session(request):
        # Compressed whole, as a tentative session: it may be a chat's first turn. At all but
        # its last token where the budget leaves room there (see FIRST_POINT): a repeat of the
        # prompt then adopts this cache.
        first_at = num_prompt_tokens - FIRST_POINT
        first = dataclasses.replace(
            request, compress_at=first_at if _room_at(request, first_at) else None, session=True
        )
        return dataclasses.replace(resolve(first, num_prompt_tokens, max_model_len),
                                   tentative=True)  # fmt: skip
    return resolve(dataclasses.replace(request, compress_at=at), num_prompt_tokens, max_model_len)


# ============================================================================================
# 5. What the engine configuration refuses
# ============================================================================================

# The scheduler EngineCore must build, and vLLM's own (which the plugin replaces by it), by
# qualified name: admission imports no EngineCore class (tests/unit/test_admission_rules.py
# checks both names against the classes).
OUR_SCHEDULER = "obcache_vllm.vllm_ext.engine.scheduler.OBCacheScheduler"
VLLM_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"


def _qualified(cls) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"


def scheduler_refusal(scheduler_config) -> str | None:
    """Why EngineCore would build a scheduler that never evicts, or None."""
    try:
        cls = scheduler_config.get_scheduler_cls()
    except Exception as exc:  # a user class that does not import here
        return f"--scheduler-cls {scheduler_config.scheduler_cls!r} could not be checked ({exc})"
    chain = {_qualified(c) for c in getattr(cls, "__mro__", (cls,))}
    if _qualified(cls) == VLLM_SCHEDULER or OUR_SCHEDULER in chain:
        return None
    name = scheduler_config.scheduler_cls
    if not isinstance(name, str):
        name = _qualified(cls)
    return (f"--scheduler-cls {name} is not supported with kv_budget: it must be (a subclass of) "
            f"{OUR_SCHEDULER}")  # fmt: skip


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


def _window_reason(vllm_config, capabilities: Capabilities) -> str | None:
    """Why a model with sliding windows cannot take budgets, or None (none, or interleaved with
    global layers, vLLM's hybrid KV-cache manager on, an adapter serving several groups)."""
    if vllm_config.model_config.get_sliding_window() is None:
        return None
    if not interleaved(vllm_config):
        return ("sliding-window models other than those interleaving sliding-window and global "
                "layers (layer_types) are not supported with kv_budget (vLLM already frees the "
                "blocks behind each layer's window)")  # fmt: skip
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        return ("a sliding-window model with the hybrid KV-cache manager disabled is not "
                "supported with kv_budget (its window and global layers share one group)")
    if not capabilities.several_groups:
        # FLASH_ATTN shifts the batch's sequence lengths in place, and vLLM shares that tensor
        # between the groups: the sliding-window layers would read short rows.
        return ("sliding-window models are supported with kv_budget on vLLM's CPU attention "
                "backend only (not FlashAttention yet)")
    return None


def engine_refusal(vllm_config, capabilities: Capabilities) -> str | None:
    """Why budgeted requests cannot be served by this engine configuration, or None (the
    table in the module docstring)."""
    reason = platform_refusal(vllm_config, capabilities)
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
    reason = _window_reason(vllm_config, capabilities)
    if reason is not None:
        return reason
    if model_config.use_mla:
        return "MLA (multi-head latent attention) models are not supported with kv_budget"
    shared = getattr(model_config.hf_text_config, "num_kv_shared_layers", 0) or 0
    if shared > 0:
        return (
            f"models with KV-sharing layers ({shared} layers reuse another layer's KV cache) "
            "are not supported with kv_budget"
        )
    if vllm_config.cache_config.kv_sharing_fast_prefill:  # it cuts the sharing layers' tokens
        return "KV-sharing fast prefill (kv_sharing_fast_prefill) is not supported with kv_budget"
    if vllm_config.use_v2_model_runner:
        return "the V2 model runner is not supported with kv_budget (VLLM_USE_V2_MODEL_RUNNER=0)"
    if vllm_config.scheduler_config.async_scheduling:
        return "async scheduling is not supported with kv_budget (--no-async-scheduling)"
    return scheduler_refusal(vllm_config.scheduler_config)


def serves_sessions(vllm_config) -> bool:
    """Whether the engine serves sessions at all: prefix caching on (the continued cache lives
    in vLLM's prefix cache), no speculative decoding, one KV-cache group to evict in."""
    return bool(
        vllm_config.cache_config.enable_prefix_caching
        and getattr(vllm_config, "speculative_config", None) is None
        and not interleaved(vllm_config)
    )


SPECULATIVE_REFUSAL = ("is not supported with speculative decoding (decode-time eviction is "
                       "not exact under draft rollback); budgets that evict at the prompt's end "
                       "are")  # fmt: skip
HYBRID_REFUSAL = ("is not supported on a model with sliding-window layers yet (budgets evict in "
                  "its global layers; a session's continued cache is not built for several "
                  "KV-cache groups)")  # fmt: skip
# Why a streaming-input request (vLLM's ``StreamingInput``, ``resumable``) gets no budget.
STREAMING_REFUSAL = (
    "not supported for streaming-input requests: vLLM schedules each input chunk as a new "
    "request over the blocks the last one left, which a compressed cache (its head blocks "
    "returned to the pool) cannot be continued from yet"
)


def speculative_refusal(vllm_config, options: KvOptions) -> tuple[str, Any] | None:
    """``(field, value)`` refused with speculative decoding, or None.

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


def hybrid_refusal(vllm_config, options: KvOptions) -> tuple[str, Any] | None:
    """``(field, value)`` an interleaved sliding-window model cannot serve yet, or None.

    Budgets evict in such a model's global layers at the prompt's end, at a compress point
    (the rest of the prompt computed on the compressed cache, but no entry left for another
    request), after every prefill chunk (admitted by its bounded peak plus what the
    sliding-window groups hold) and at decode steps, to a fixed budget or an error target,
    uniform or per head, always or under pressure; its sliding-window layers run as stock. Not
    built for several KV-cache groups: sessions (an entry would need the sliding groups'
    window blocks as well: with this refusal lifted, a session's next turn continues
    nothing). A budgeted request on such a model reads nothing from the prefix cache
    (``PrefixAdapter.enabled``)."""
    if interleaved(vllm_config) and options.session:
        return "kv_session", True
    return None


def heads_memory_refusal(vllm_config, capabilities: Capabilities, options: KvOptions):
    """Why a pipeline whose heads own their memory (adakv) cannot run on this engine, or None:
    per-head memory is built for an adapter that declares it, on one rank (each rank would
    spread its own KV heads' budget and report its own layout)."""
    if not options.heads_own_memory:
        return None
    name = options.pipeline
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        return (f"{name} is not supported with tensor parallelism yet (each rank would spread "
                "its own KV heads' budget and report its own layout)")  # fmt: skip
    if not capabilities.per_head_memory:
        return (f"{name} needs per-head memory, built for vLLM's CPU attention backend only "
                "(not FlashAttention yet)")  # fmt: skip
    return None


def _kl_calibrations(vllm_config) -> tuple:
    """The served model's shipped KL calibrations, one per selection measured (maybe none:
    :func:`calibration.for_model`)."""
    from obcache_vllm.scoring import calibration

    model = vllm_config.model_config
    return calibration.for_model(model.model, model.get_num_layers(vllm_config.parallel_config))


def kl_calibration_refusal(vllm_config, options: KvOptions) -> tuple[str, str] | None:
    """``(field, why)`` where this engine's model has no KL calibration for a ``max_kl``
    target, or none measured with the request's selection (the field named is the first that
    differs from the closest one's: :mod:`obcache_vllm.scoring.calibration`); None where the
    target can be served."""
    from obcache_vllm.scoring import calibration

    model = vllm_config.model_config
    layers = model.get_num_layers(vllm_config.parallel_config)
    found = _kl_calibrations(vllm_config)
    if not found:
        name, have = calibration.model_key(model.model), ", ".join(calibration.shipped())
        return ("kv_budget", f"a KL target needs a calibration of {name} ({layers} layers) and "
                f"none ships (calibrated: {have or 'none'}; scripts/error_predictor_eval.py "
                '--write-calibration makes one); {"max_error": e} works on every model')
    mismatch = calibration.closest(found, options).mismatch(options)
    if mismatch is None:
        return None
    field, why = mismatch
    if len(found) > 1:  # the closest one's settings are in `why`; name the others too
        why += " (calibrated selections: " + "; ".join(
            ", ".join(f"kv_{k} {json.dumps(v)}" for k, v in c.setting.items()) for c in found) + ")"
    return field, f"a KL target: {why}"


def kl_selection(vllm_config, request: KvRequest) -> KvRequest:
    """A KL target (``max_kl``) whose request named no selection field, with the selection of
    its model's calibration closest to the defaults it was given (the server's shipped
    selection where a calibration was measured with it, else the one sharing most of its
    fields: :func:`calibration.closest`): a predicted KL holds for a calibrated selection only
    (:func:`kl_calibration_refusal` refuses any other). Any other request, or a model without
    a calibration (refused later, naming it), is returned as it is."""
    budget = request.budget
    if not (isinstance(budget, options.ErrorTarget) and budget.kl):
        return request
    from obcache_vllm.scoring.calibration import SETTING_FIELDS, closest

    found = closest(_kl_calibrations(vllm_config), request)
    if found is None:
        return request
    return dataclasses.replace(request, **{k: found.setting[k] for k in SETTING_FIELDS})


def request_refusal(vllm_config, capabilities: Capabilities, options: KvOptions) -> None:
    """What this engine cannot serve of these resolved options: an error target with tensor
    parallelism (each rank would choose from its own KV heads), :func:`heads_memory_refusal`,
    :func:`speculative_refusal`, :func:`hybrid_refusal`, a session without prefix caching.

    Raises:
        KvOptionsError: naming the field that cannot be honoured.
    """
    if options.max_error is not None and vllm_config.parallel_config.tensor_parallel_size > 1:
        raise KvOptionsError(
            "kv_budget",
            "an error target is not supported with tensor parallelism yet (each rank would "
            "choose from its own KV heads)",
            options.requested_budget,
        )
    if options.kl_target:
        refused = kl_calibration_refusal(vllm_config, options)
        if refused is not None:
            name, why = refused
            raise KvOptionsError(name, why, options.requested_budget if name == "kv_budget"
                                 else getattr(options, name.removeprefix("kv_")))  # fmt: skip
    reason = heads_memory_refusal(vllm_config, capabilities, options)
    if reason is not None:
        raise KvOptionsError("kv_pipeline", reason, options.pipeline)
    for rule, why in ((speculative_refusal, SPECULATIVE_REFUSAL), (hybrid_refusal, HYBRID_REFUSAL)):
        refused = rule(vllm_config, options)
        if refused is not None:
            name, value = refused
            raise KvOptionsError(name, f"{name} {why}", value)
    if options.session and not vllm_config.cache_config.enable_prefix_caching:
        raise KvOptionsError(
            "kv_session",
            "needs prefix caching (the continued cache lives in vLLM's prefix cache); the "
            "server runs with --no-enable-prefix-caching",
            True,
        )


# ============================================================================================
# 6. Whether a request can ever fit the KV pool
# ============================================================================================


def pool_blocks(vllm_config) -> int | None:
    """Blocks a request can use (the null block excluded); None before the engine is up."""
    blocks = vllm_config.cache_config.num_gpu_blocks
    return None if not blocks else blocks - 1


def pool_is_short(vllm_config) -> bool:
    """Whether the pool holds less than one request of ``max_model_len`` tokens (only then
    can a stock request be too big for it; vLLM's length checks cover the rest)."""
    usable = pool_blocks(vllm_config)
    if usable is None:
        return False
    bs = vllm_config.cache_config.block_size
    return usable * bs < vllm_config.model_config.max_model_len


def capacity_error(
    vllm_config, prompt_len: int, max_tokens: int | None, options: KvOptions | None
) -> KvOptionsError | None:
    """Why this request can never fit the KV pool, or None.

    Stock vLLM refuses to start when the KV pool cannot hold one request of ``max_model_len``
    tokens. With ``kv_prefill_evict`` a budgeted request holds at most its bounded peak
    (:func:`obcache_vllm.eviction.planning.peak_blocks`), so the plugin relaxes that start-up
    check (:mod:`obcache_vllm.vllm_ext.engine.pool_check`) and refuses here, naming the
    field, every request whose worst case does not fit the pool: a stock request (prompt +
    ``max_tokens``), a budgeted one whose prompt must be held whole (no ``kv_prefill_evict``),
    or one whose bounded peak is too big. In a pool that holds ``max_model_len`` tokens this
    never triggers: vLLM's own length checks already imply it.
    """
    usable = pool_blocks(vllm_config)
    if usable is None:
        return None
    block_size = vllm_config.cache_config.block_size
    # kv_when "pressure": a prompt that does not fit is admitted compressed while prefilled.
    bounded_peak = options is not None and (options.prefill_evict or options.when == "pressure")
    if max_tokens is None:
        max_tokens = vllm_config.model_config.max_model_len - prompt_len
    peak = peak_blocks(
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        block_size=block_size,
        chunk=vllm_config.scheduler_config.max_num_batched_tokens,
        budget=None if options is None or options.max_error is not None else options.budget,
        decode=options is not None and options.decode,
        prefill_evict=bounded_peak,
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
    if not bounded_peak and -(-prompt_len // block_size) > usable:
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


def check_fits(vllm_config, num_prompt_tokens: int, max_tokens, options) -> None:
    """Raise the :func:`capacity_error` of a request that can never fit the pool."""
    error = capacity_error(vllm_config, num_prompt_tokens, max_tokens, options)
    if error is not None:
        raise error


# ============================================================================================
# 7. The request: fields in, Admitted out
# ============================================================================================


@dataclass(frozen=True)
class Requested:
    """A request's kv_* options parsed (:func:`parse`), the prompt not known yet.

    ``waived_below``: where the budget is the server policy's (the client asked for none),
    the prompt length under which the policy does not apply and the request is served as
    stock vLLM; None for the client's own budget, which is never waived.
    ``selection_named``: the request named one of :data:`SELECTION_FIELDS` itself (False: its
    selection is the server's defaults', which a KL target replaces with its calibration's:
    :meth:`Admission.admit`).
    """

    request: KvRequest
    waived_below: int | None = None
    selection_named: bool = True


@dataclass(frozen=True)
class Admitted:
    """A request's options after :meth:`Admission.admit`: resolved, not refused, fitting the
    pool. ``request``: what it was resolved from, for one late decision (a vLLM
    ``session_id``: :meth:`Admission.join_session`). ``from_policy``: the budget is the server
    policy's (the client asked for none): where a later check refuses it, the request is
    served as stock vLLM instead."""

    options: KvOptions
    request: KvRequest | None = None
    from_policy: bool = False


def parse(fields: Mapping[str, Any] | None, policy: Policy | None = None) -> Requested | None:
    """The one parse of a request's kv_* ``fields`` (the client's, or an orchestrator's
    ``kv_hints``): over ``policy``'s defaults where one is given (the server's; the offline
    ``LLM`` has none). None: no budget, a stock request.

    Raises:
        KvOptionsError: an unknown ``kv_*`` key, a value out of its domain, a combination the
            request cannot have.
    """
    fields = {k: v for k, v in (fields or {}).items() if is_kv_option(k)}
    if policy is None:
        request = parse_request(fields)
        return None if request is None else Requested(request)
    merged = policy_fields(policy, fields)
    from_policy = "kv_budget" not in fields and merged.get("kv_budget") is not None
    request = parse_request(merged)
    if request is None:
        return None
    return Requested(request, policy.min_prompt_tokens if from_policy else None,
                     selection_named=any(f in fields for f in SELECTION_FIELDS))  # fmt: skip


# The front end's own extra_args keys, one type each, while a served request is between its
# steps: the server's parse leaves a Requested, its prompt check an Admitted in its place; the
# input processor's step takes both off and writes the wire tuple under options.ADMITTED_KEY
# (which holds nothing else). A key never changes type.
REQUESTED_KEY = "obcache_requested"
CHECKED_KEY = "obcache_admitted"
STAGE_KEYS = {REQUESTED_KEY: Requested, CHECKED_KEY: Admitted}
RESERVED_KEYS = (options.ADMITTED_KEY, *STAGE_KEYS)


def refuse_reserved(vllm_xargs: Mapping[str, Any] | None) -> None:
    """The plugin's own extra_args keys: a client cannot send them."""
    for key in RESERVED_KEYS:
        if vllm_xargs and key in vllm_xargs:
            raise KvOptionsError("vllm_xargs", f"the key {key!r} is reserved for obcache-vllm",
                                 key)  # fmt: skip


def refuse_foreign(extra: Mapping[str, Any]) -> None:
    """What the plugin's keys hold before the input processor's step is admission's own (a
    :class:`Requested`, an :class:`Admitted`, made by the server's seams) or nothing; anything
    else came from outside (an offline caller's ``extra_args``, a forged wire tuple) and is
    refused."""
    for key in RESERVED_KEYS:
        value = extra.get(key)
        if value is not None and not isinstance(value, STAGE_KEYS.get(key, ())):
            raise KvOptionsError(key, "is reserved for obcache-vllm's admission", value)


def refuse_beam_search(fields: Mapping[str, Any]) -> None:
    """Beam search builds its own sampling requests: explicit kv_* fields are refused (the
    server's defaults do not apply to it)."""
    if fields:
        name = next(iter(fields))
        raise KvOptionsError(name, "is not supported with use_beam_search", fields[name])


# The kv_hints action that carries kv_* options (vLLM's KvHintsEnvelope, v1/kv_hints/protocol.py):
# an orchestrator that drives the engine API sets a request's budget or session with it.
HINT_ACTION_TYPE = "obcache.kv_options"
HINT_ACTION_VERSION = "1"


def hinted_fields(kv_hints) -> dict[str, Any]:
    """The kv_* fields of a request's ``kv_hints`` envelope: the payload of its
    ``obcache.kv_options`` action (version ``1``; other actions are other components'), or
    ``{}``. The payload holds request fields by their request names (``{"kv_budget": 0.25}``).

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


@dataclass(frozen=True)
class Prompt:
    """What admission reads of a request's prompt: its length, whether it carries embeddings
    (all or some positions), its token ids, the request's ``max_tokens``, and what besides its
    tokens decides whether two prompts may share KV (its cache salt and LoRA adapter, as in
    vLLM's block hashes: the seed of ``kv_compress_at: "auto"``'s index)."""

    length: int
    embeds: bool = False
    token_ids: Any = None
    max_tokens: int | None = None
    cache_salt: Any = None
    lora_name: str | None = None

    @property
    def seed(self):
        return (self.cache_salt, self.lora_name)


@dataclass(frozen=True)
class Admission:
    """Admission for one engine: its configuration, the platform's declared capabilities and
    its index of recently seen prompts (``kv_compress_at: "auto"``; one per engine, as one
    server has one). Built once per engine by the input processor's seam."""

    vllm_config: Any
    capabilities: Capabilities
    sightings: PrefixSightings | None = field(default=None, compare=False)

    @classmethod
    def for_engine(cls, vllm_config, backend: str) -> Admission:
        block_size = vllm_config.cache_config.block_size
        return cls(vllm_config, CAPABILITIES[backend], PrefixSightings(block_size))

    def refusal(self) -> str | None:
        """Why this engine serves no budget at all, or None (:func:`engine_refusal`)."""
        return engine_refusal(self.vllm_config, self.capabilities)

    def _auto(self, request: KvRequest, prompt: Prompt):
        """``(point, continues)`` of a ``kv_compress_at: "auto"`` request (see
        :mod:`obcache_vllm.eviction.sightings`): the compress point (None: its whole prompt)
        and whether it continues a recent prompt (then it is served as ``kv_session``).
        Records the prompt. Without prefix caching nothing is shared: ``(None, False)``."""
        if not self._sights(request, prompt):
            return None, False
        seen = self.sightings.observe(prompt.token_ids, prompt.seed)
        return auto_point(seen.shared, prompt.length, seen.point), seen.continues

    def _sights(self, request: KvRequest, prompt: Prompt) -> bool:
        return (
            request.compress_at == AUTO
            and prompt.token_ids is not None
            and not prompt.embeds
            and self.sightings is not None
            and self.vllm_config.cache_config.enable_prefix_caching
            # no entries on several KV-cache groups: the whole prompt
            and not interleaved(self.vllm_config)
        )

    def admit(self, requested: Requested, prompt: Prompt) -> Admitted | None:
        """Resolve ``requested`` on its prompt, refuse what this engine cannot serve, check it
        fits. ``None``: the budget was the server policy's and does not apply (a prompt below
        its threshold, or a request it cannot serve): a stock request, since the client asked
        for no budget.

        Raises:
            KvOptionsError: a bad option for this prompt, a refusal, or a request that can
                never fit the KV pool.
        """
        request, threshold = requested.request, requested.waived_below
        if threshold is not None and prompt.length < threshold:
            return None
        if not requested.selection_named:
            request = kl_selection(self.vllm_config, request)
        try:
            options = self._decide(request, prompt)
        except KvOptionsError:
            if threshold is not None:
                return None
            raise
        if self._sights(request, prompt):
            # where it was compressed: the same prompt again compresses there, adopting its entry
            self.sightings.remember(prompt.token_ids, prompt.seed, options.compress_at)
        return Admitted(options, request, from_policy=threshold is not None)

    def _decide(self, request: KvRequest, prompt: Prompt) -> KvOptions:
        config = self.vllm_config
        point, continued = self._auto(request, prompt)
        options = resolve(request, prompt.length, config.model_config.max_model_len,
                          auto_point=point, auto_session=continued,
                          sessions=serves_sessions(config))  # fmt: skip
        reason = self.refusal()
        if reason is not None:
            raise KvOptionsError("kv_budget", reason, options.budget)
        if prompt.embeds:
            raise KvOptionsError(
                "kv_budget", "not supported for requests with prompt embeddings (prompt_embeds)",
                options.budget,
            )  # fmt: skip
        request_refusal(config, self.capabilities, options)
        check_fits(config, prompt.length, prompt.max_tokens, options)
        return options

    def join_session(self, admitted: Admitted, session_id, prompt: Prompt) -> Admitted:
        """The request carries vLLM's ``session_id`` (its body, the ``X-Session-ID`` header or
        ``vllm_xargs``; vLLM resolves them onto the engine request): it takes part in that
        session, as ``kv_session`` would (its entry is found by its tokens, so a turn
        continues the cache its session's last turn left), where its options allow one
        (:func:`joins_session`) and the engine serves sessions. A request the session would
        not fit keeps its own options."""
        request = admitted.request
        if (
            not session_id
            or prompt.embeds
            or request is None
            or admitted.options.session
            or not joins_session(request)
            or not serves_sessions(self.vllm_config)
        ):
            return admitted
        max_len = self.vllm_config.model_config.max_model_len
        try:
            options = resolve(request, prompt.length, max_len, session_id=session_id)
            check_fits(self.vllm_config, prompt.length, prompt.max_tokens, options)
        except KvOptionsError:
            return admitted
        return Admitted(options, request, admitted.from_policy)

    def streaming(self, admitted: Admitted) -> Admitted | None:
        """A streaming-input request (``resumable``): refused with the client's own budget;
        served as stock with the policy's (None)."""
        if admitted.from_policy:
            return None
        raise KvOptionsError("kv_budget", STREAMING_REFUSAL, admitted.options.budget)

    def engine_extra_args(self, extra: Mapping[str, Any], prompt: Prompt, *, kv_hints=None,
                          session_id: str | None = None, resumable: bool = False):
        """A request's ``extra_args`` as it leaves the front end (the input processor's step,
        for every front end): ``extra`` itself where nothing changes, else a new mapping with
        the admitted options' wire tuple under ``ADMITTED_KEY`` (or without any kv_* field:
        a stock request).

        * an :class:`Admitted` under :data:`CHECKED_KEY` (the server admitted it on the
          rendered prompt): encoded as is, or joined to vLLM's ``session_id``
          (:meth:`join_session`).
        * a :class:`Requested` under :data:`REQUESTED_KEY` (parsed by the server, not
          admitted yet): admitted here.
        * raw ``kv_*`` fields (offline ``LLM``, the engine API): parsed and admitted here.
        * anything else under the plugin's keys: refused (:func:`refuse_foreign`).
        * no options: a stock request; only the pool's size can refuse it.

        The engine API's ``kv_hints`` (:func:`hinted_fields`) give a request kv_* fields an
        orchestrator chose: the request's own kv_* fields win field by field, the hint fills
        in the rest (a request the server already parsed or admitted keeps its own). A
        streaming-input request (``resumable``) is refused, or served as stock where the
        budget was the policy's (:meth:`streaming`).

        Raises:
            KvOptionsError: naming the field.
        """
        ours = [key for key in RESERVED_KEYS if key in extra]
        hints = hinted_fields(kv_hints) if not ours else {}
        if not ours and not hints and not any(is_kv_option(k) for k in extra):
            if prompt.length and pool_is_short(self.vllm_config):
                check_fits(self.vllm_config, prompt.length, prompt.max_tokens, None)
            return extra
        refuse_foreign(extra)
        rest = {k: v for k, v in extra.items()
                if not is_kv_option(k) and k not in RESERVED_KEYS}  # fmt: skip
        admitted = extra.get(CHECKED_KEY)
        if admitted is None:
            own = {k: v for k, v in extra.items() if is_kv_option(k)}
            requested = extra.get(REQUESTED_KEY) or parse({**hints, **own})
            if requested is None:  # "kv_budget": null: a stock request, its fields dropped
                return rest
            admitted = self.admit(requested, prompt)
        if admitted is not None and resumable:
            admitted = self.streaming(admitted)
        if admitted is None:  # the policy's budget does not apply: a stock request
            return rest
        admitted = self.join_session(admitted, session_id, prompt)
        return {**rest, options.ADMITTED_KEY: admitted.options.to_wire()}
