"""The OpenAI server side (API-server process): kv_* request fields, KV outcome in ``usage``.

Installed in the process that runs vLLM's OpenAI server, where vLLM's app builder is loaded:
the ``server`` rows of the seam registry (:data:`obcache_vllm.vllm_ext.seams.REGISTRY`) name
the wrappers below, and :func:`obcache_vllm.vllm_ext.install.install_api_server` applies them
after :func:`server_policy` has loaded and validated the server defaults. vLLM's own server
and protocol stay in charge; the wrappers only:

* ``ChatCompletionRequest.to_sampling_params`` / ``CompletionRequest.to_sampling_params``:
  collect the kv_* options from top-level request fields (kept by vLLM's pydantic models in
  ``model_extra``) and from ``vllm_xargs`` (top-level wins), over the server defaults
  (:mod:`obcache_vllm.config`), and parse them: admission's stage 1
  (:func:`~obcache_vllm.admission.parse`, the policy passed in). The
  :class:`~obcache_vllm.admission.Requested` replaces the raw fields in
  ``SamplingParams.extra_args`` (under ``admission.REQUESTED_KEY``). A request that sets no
  kv_* field (and meets no default budget) is left exactly as vLLM made it.
* ``to_beam_search_params``: beam search builds its own sampling requests, so explicit kv_*
  fields with ``use_beam_search`` are a 400 (server defaults do not apply to it).
* ``AsyncLLM.generate``: admission on the rendered prompt
  (:meth:`~obcache_vllm.admission.Admission.admit`: the budget resolved, the
  refusals, the pool's capacity), where every generate handler hands the prompt and its
  ``SamplingParams`` to the engine, synchronously (``generate`` returns an async generator
  that has not started). Raising there becomes vLLM's HTTP 400 even for a stream, whose 200
  is sent only after the handler returns. vLLM's own checks against the prompt
  (``InputProcessor.process_inputs``) run only when the generator is first iterated, inside
  a stream's 200, so the input processor then only encodes the admitted options
  (``intake.admit_engine_request``): the offline ``LLM`` and the engine API are admitted
  there, in one step.
* The chat/completion response builders: the scheduler puts each budgeted request's KV outcome
  on its outputs (``kv_transfer_params["obcache"]``, see ``wire.OUTCOME_KEY``); it is taken
  off there (the response's ``kv_transfer_params`` stays as stock vLLM makes it) and reported
  as ``usage.obcache``: in the response, or in the final usage chunk of a stream
  (``stream_options.include_usage``).
* ``register_api_routers``: adds ``GET /v1/obcache/config`` (scorers, pipelines, defaults).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from typing import Any

from obcache_vllm import admission, config, options
from obcache_vllm.admission import Prompt, Requested
from obcache_vllm.options import KvOptionsError, is_kv_option
from obcache_vllm.vllm_ext.frontend import intake
from obcache_vllm.vllm_ext.wire import OUTCOME_KEY

logger = logging.getLogger(__name__)

CONFIG_ROUTE = "/v1/obcache/config"
USAGE_KEY = "obcache"
# Reported per prompt; summed over the prompts of a multi-prompt completion.
SUMMED_FIELDS = (
    "resident_tokens",
    "evicted_tokens",
    "freed_blocks",
    "evictions",
    "prompt_tokens_kept",
    "cached_tokens",
    "reused_tokens",
)

_policy: admission.Policy | None = None
_served_model: str | None = None


def server_policy() -> admission.Policy:
    """The validated server policy: kv_* defaults and their threshold (loaded once, and again
    once the served model is known: :func:`set_served_model`)."""
    global _policy
    if _policy is None:
        _policy = config.load_policy(model=_served_model)
    return _policy


def set_served_model(model: str | None) -> None:
    """The model this server serves (its path or hub id), known when vLLM registers the API
    routes, before the first request: the policy is loaded again with that model's own
    selection where the file has one (``models``, :func:`obcache_vllm.config.load_policy`).
    The plugin validated the file at install, before vLLM had parsed its arguments."""
    global _policy, _served_model
    _served_model = model
    _policy = None


def server_defaults() -> dict[str, Any]:
    """The validated server-wide kv_* defaults."""
    return server_policy().defaults


def reset_defaults(
    defaults: dict[str, Any] | None = None,
    min_prompt_tokens: int = 0,
    compress_at: str | None = options.AUTO,
    query_agnostic: dict[str, Any] | None = None,
) -> None:
    """Replace the cached policy (tests); ``None`` reloads it on next use."""
    global _policy
    _policy = (
        None if defaults is None
        else admission.Policy(defaults, min_prompt_tokens, compress_at, query_agnostic)
    )  # fmt: skip


# --- request fields -> SamplingParams.extra_args --------------------------------------------


def requested_kv_fields(vllm_xargs: Mapping[str, Any] | None, top_level: Mapping[str, Any] | None):
    """The kv_* fields a request set: ``vllm_xargs`` first, top-level fields over them."""
    fields = {k: v for k, v in (vllm_xargs or {}).items() if is_kv_option(k)}
    fields.update({k: v for k, v in (top_level or {}).items() if is_kv_option(k)})
    return fields


def parse_fields(vllm_xargs: Mapping[str, Any] | None, top_level: Mapping[str, Any] | None):
    """The request's :class:`~obcache_vllm.admission.Requested` (its fields over the server
    policy), or None.

    Raises:
        KvOptionsError: a bad field, or the reserved key sent by the client.
    """
    admission.refuse_reserved(vllm_xargs)
    return admission.parse(requested_kv_fields(vllm_xargs, top_level), server_policy())


def _wrap_to_sampling_params(original):
    @functools.wraps(original)
    def to_sampling_params(self, *args, **kwargs):
        try:
            # Before vLLM's own checks: its range check of extra_args would reject an int
            # beyond 64 bits in vllm_xargs as "extra_args", without naming the kv_* field.
            request = parse_fields(self.vllm_xargs, self.model_extra)
        except KvOptionsError as exc:
            raise intake.rejected(exc) from exc
        params = original(self, *args, **kwargs)
        extra = params.extra_args or {}
        if request is None and not any(is_kv_option(k) for k in extra):
            return params  # a stock request, untouched
        rest = {k: v for k, v in extra.items() if not is_kv_option(k)}
        if request is not None:
            rest[admission.REQUESTED_KEY] = request
        params.extra_args = rest or None
        return params

    to_sampling_params.__obcache_wrapped__ = True
    return to_sampling_params


def _wrap_to_beam_search_params(original):
    @functools.wraps(original)
    def to_beam_search_params(self, *args, **kwargs):
        try:
            admission.refuse_beam_search(requested_kv_fields(self.vllm_xargs, self.model_extra))
        except KvOptionsError as exc:
            raise intake.rejected(exc) from exc
        return original(self, *args, **kwargs)

    to_beam_search_params.__obcache_wrapped__ = True
    return to_beam_search_params


def admit_rendered_prompt(gate: admission.Admission, inputs, params, lora_request=None) -> None:
    """Admission of one rendered prompt on its way into the engine (see the module docstring).

    ``gate``: the engine's :class:`~obcache_vllm.admission.Admission`; ``inputs``: the
    handler's rendered prompt (an ``EngineInput``); ``params``: its sampling parameters, whose
    ``extra_args`` hold the request's ``Requested`` when it has kv_* fields or meets the
    policy's budget.

    Raises:
        KvOptionsError: a bad option for this prompt, a refusal, or a request that can never
            fit the KV pool.
    """
    from vllm.renderers.inputs.preprocess import extract_prompt_components

    extra = getattr(params, "extra_args", None)  # None for beam search and pooling
    requested = extra.get(admission.REQUESTED_KEY) if extra else None
    vllm_config = gate.vllm_config
    if isinstance(requested, Requested):
        components = extract_prompt_components(vllm_config.model_config, inputs)
        token_ids, embeds = components.token_ids, components.embeds
        if token_ids is not None:
            num_prompt = len(token_ids)
        else:
            num_prompt = len(embeds) if embeds is not None else 0
        salt = inputs.get("cache_salt") if isinstance(inputs, Mapping) else None
        prompt = Prompt(num_prompt, embeds is not None, token_ids, max_tokens=params.max_tokens,
                        cache_salt=salt, lora_name=getattr(lora_request, "lora_name", None))
        admitted = gate.admit(requested, prompt)
        if admitted is None:  # the policy's budget does not apply here: a stock request
            del extra[admission.REQUESTED_KEY]
            params.extra_args = extra or None
        else:  # the stage object leaves its key; the admitted one takes its own
            del extra[admission.REQUESTED_KEY]
            extra[admission.CHECKED_KEY] = admitted
    elif hasattr(params, "extra_args") and admission.pool_is_short(vllm_config):
        token_ids = extract_prompt_components(vllm_config.model_config, inputs).token_ids
        if token_ids is not None:
            admission.check_fits(vllm_config, len(token_ids), params.max_tokens, None)


def _wrap_generate(original):
    """``AsyncLLM.generate``: admission of a rendered prompt where the handler hands it to the
    engine. ``generate`` is an async generator function: calling it runs nothing, so this
    plain function admits first and then returns the generator; a refusal leaves the handler
    before it returns, which vLLM turns into an HTTP 400, for a stream too (its 200 is sent
    only after the handler returns). Prompts that are not rendered ``EngineInput`` dicts
    (raw prompts, ``EngineCoreRequest``, streaming input) are left to the input processor."""

    @functools.wraps(original)
    def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        if isinstance(prompt, Mapping) and "type" in prompt:
            try:
                admit_rendered_prompt(intake.admission_of(self.input_processor), prompt,
                                      sampling_params, kwargs.get("lora_request"))  # fmt: skip
            except KvOptionsError as exc:
                raise intake.rejected(exc) from exc
        return original(self, prompt, sampling_params, request_id, *args, **kwargs)

    generate.__obcache_wrapped__ = True
    return generate


# --- KV outcome: engine outputs -> usage.obcache --------------------------------------------


def take_outcome(res) -> dict | None:
    """Remove our outcome from a ``RequestOutput``'s ``kv_transfer_params`` and return it."""
    params = getattr(res, "kv_transfer_params", None)
    if not params or OUTCOME_KEY not in params:
        return None
    rest = {k: v for k, v in params.items() if k != OUTCOME_KEY}
    res.kv_transfer_params = rest or None
    return params[OUTCOME_KEY]


def combine(outcomes: Mapping[int, dict]) -> dict | None:
    """One prompt's outcome, or the sum over a multi-prompt request (options of the first)."""
    if not outcomes:
        return None
    ordered = [outcomes[k] for k in sorted(outcomes)]
    if len(ordered) == 1:
        return dict(ordered[0])
    total = dict(ordered[0])
    for field in SUMMED_FIELDS:
        total[field] = sum(o.get(field, 0) for o in ordered)
    total["requests"] = len(ordered)
    return total


def _tap(source, sink: dict[int, dict]):
    """Pass ``source``'s outputs through, recording (and removing) each one's KV outcome."""

    async def tapped():
        try:
            async for item in source:
                index, res = item if isinstance(item, tuple) else (0, item)
                outcome = take_outcome(res)
                if outcome is not None:
                    sink[index] = outcome
                yield item
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    return tapped()


def _put_usage(response, outcomes: Mapping[int, dict]) -> None:
    outcome = combine(outcomes)
    usage = getattr(response, "usage", None)
    if outcome is not None and usage is not None:
        setattr(usage, USAGE_KEY, outcome)  # pydantic extra="allow": serialized with usage


def _inject_into_usage_chunk(chunk: str, outcomes: Mapping[int, dict]) -> str:
    """Add ``usage.obcache`` to the final SSE usage chunk (``choices: []``); others unchanged."""
    if not chunk.startswith("data: {") or '"usage"' not in chunk or '"choices":[]' not in chunk:
        return chunk
    outcome = combine(outcomes)
    if outcome is None:
        return chunk
    body = json.loads(chunk[len("data: ") :])
    if not isinstance(body.get("usage"), dict) or body.get("choices"):
        return chunk
    body["usage"][USAGE_KEY] = outcome
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _wrap_full_generator(original):
    """Wrap ``OpenAIServingChat.chat_completion_full_generator``."""

    @functools.wraps(original)
    async def chat_completion_full_generator(self, request, result_generator, *args, **kwargs):
        outcomes: dict[int, dict] = {}
        response = await original(self, request, _tap(result_generator, outcomes), *args, **kwargs)
        _put_usage(response, outcomes)
        return response

    chat_completion_full_generator.__obcache_wrapped__ = True
    return chat_completion_full_generator


def _wrap_stream_generator(original, position: int):
    """A stream generator whose ``result_generator`` is positional argument ``position``."""

    @functools.wraps(original)
    async def stream_generator(self, *args, **kwargs):
        outcomes: dict[int, dict] = {}
        if "result_generator" in kwargs:
            kwargs["result_generator"] = _tap(kwargs["result_generator"], outcomes)
        else:
            args = list(args)
            args[position] = _tap(args[position], outcomes)
        inner = original(self, *args, **kwargs)
        try:
            async for chunk in inner:
                if outcomes:
                    chunk = _inject_into_usage_chunk(chunk, outcomes)
                yield chunk
        finally:
            await inner.aclose()

    stream_generator.__obcache_wrapped__ = True
    return stream_generator


# The two stream generators, as the registry's wrapper factories.
_wrap_chat_stream_generator = functools.partial(_wrap_stream_generator, position=1)
_wrap_completion_stream_generator = functools.partial(_wrap_stream_generator, position=2)


def _wrap_completion_response(original):
    """Wrap ``OpenAIServingCompletion.request_output_to_completion_response``."""

    @functools.wraps(original)
    def request_output_to_completion_response(self, final_res_batch, *args, **kwargs):
        outcomes = {}
        for index, res in enumerate(final_res_batch):
            outcome = take_outcome(res)
            if outcome is not None:
                outcomes[index] = outcome
        response = original(self, final_res_batch, *args, **kwargs)
        _put_usage(response, outcomes)
        return response

    request_output_to_completion_response.__obcache_wrapped__ = True
    return request_output_to_completion_response


# --- GET /v1/obcache/config ------------------------------------------------------------------


def config_document() -> dict[str, Any]:
    """What ``GET /v1/obcache/config`` returns."""
    from obcache_vllm.scoring import SCORER_NAMES, pipeline_names

    return {
        "scorers": list(SCORER_NAMES),
        "pipelines": list(pipeline_names()),
        "request_fields": list(options.FIELDS),
        "defaults": dict(server_defaults()),
        "policy": {
            "default_budget": server_defaults().get("kv_budget"),
            "when": server_defaults().get("kv_when"),
            config.MIN_PROMPT_KEY: server_policy().min_prompt_tokens,
            config.COMPRESS_AT_KEY: server_policy().compress_at,
            # the selection a request with a kv_compress_at position and no selection field
            # gets (admission.merge_fields)
            config.QUERY_AGNOSTIC_KEY: server_policy().query_agnostic,
            # the served model, whose own selection (the file's `models`) the defaults hold
            "model": config.model_name(_served_model) if _served_model else None,
            "opt_out": 'a request with "kv_budget": null is served as stock vLLM',
        },
        "usage_field": f"usage.{USAGE_KEY}",
    }


async def obcache_config_endpoint():
    from fastapi.responses import JSONResponse

    return JSONResponse(config_document())


def _wrap_register_api_routers(original):
    @functools.wraps(original)
    def register_api_routers(args, app, *rest, **kwargs):
        set_served_model(getattr(args, "model", None))
        result = original(args, app, *rest, **kwargs)
        app.add_api_route(CONFIG_ROUTE, obcache_config_endpoint, methods=["GET"])
        return result

    register_api_routers.__obcache_wrapped__ = True
    return register_api_routers
