"""The OpenAI server side (API-server process): kv_* request fields, KV outcome in ``usage``.

Installed by :func:`install_server` in the process that runs vLLM's OpenAI server (the plugin
calls it where vLLM's app builder is loaded; ``obcache-vllm serve`` calls it explicitly).
vLLM's own server and protocol stay in charge; the patches only:

* ``ChatCompletionRequest.to_sampling_params`` / ``CompletionRequest.to_sampling_params``: lift
  the kv_* options from top-level request fields (kept by vLLM's pydantic models in
  ``model_extra``) and from ``vllm_xargs`` (top-level wins) into ``SamplingParams.extra_args``,
  over the server defaults (:mod:`obcache_vllm.config`). Everything that does not depend on the
  prompt length is validated here, so a bad option is an HTTP 400 naming the field for
  streaming requests too, before anything is sent to the engine.
* ``BaseServing._log_inputs``: the checks that need the tokenized prompt (a fractional budget
  that rounds to nothing, a budget or window beyond the context, ``kv_compress_at`` past the
  prompt) and the refusals of :mod:`~obcache_vllm.vllm_ext.frontend.admission` (a budget this engine
  configuration or this request, e.g. one with prompt embeddings, cannot serve). This
  is the one call of every generate handler where the rendered prompt and the request's
  ``SamplingParams`` meet, synchronously, before ``engine_client.generate``; raising there
  becomes vLLM's HTTP 400 even for a stream, whose 200 is sent only after the handler returns.
  The input processor (``install.validate_request``) repeats the check for offline ``LLM`` use.
* The chat/completion response builders: the scheduler puts each budgeted request's KV outcome
  on its outputs (``kv_transfer_params["obcache"]``, see ``scheduler.OUTCOME_KEY``); it is taken
  off there (the response's ``kv_transfer_params`` stays as stock vLLM makes it) and reported
  as ``usage.obcache``: in the response, or in the final usage chunk of a stream
  (``stream_options.include_usage``).
* ``register_api_routers``: adds ``GET /v1/obcache/config`` (scorers, pipelines, defaults).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Mapping
from typing import Any

from obcache_vllm import config, options
from obcache_vllm.vllm_ext.frontend import admission as support
from obcache_vllm.vllm_ext.patching import patch_method
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
)

_defaults: dict[str, Any] | None = None


def server_defaults() -> dict[str, Any]:
    """The validated server-wide kv_* defaults (loaded once per process)."""
    global _defaults
    if _defaults is None:
        _defaults = config.load_defaults()
    return _defaults


def reset_defaults(defaults: dict[str, Any] | None = None) -> None:
    """Replace the cached defaults (tests); ``None`` reloads them on next use."""
    global _defaults
    _defaults = defaults


# --- request fields -> SamplingParams.extra_args --------------------------------------------


def is_kv_option(key: str) -> bool:
    """A kv_* request option (``kv_transfer_params`` is vLLM's own field, not ours)."""
    return key.startswith("kv_") and key not in options.FOREIGN_KV_KEYS


def requested_kv_fields(vllm_xargs: Mapping[str, Any] | None, top_level: Mapping[str, Any] | None):
    """The kv_* fields a request set: ``vllm_xargs`` first, top-level fields over them."""
    fields = {k: v for k, v in (vllm_xargs or {}).items() if is_kv_option(k)}
    fields.update({k: v for k, v in (top_level or {}).items() if is_kv_option(k)})
    return fields


def check_scalars(fields: Mapping[str, Any]) -> None:
    """Each value a JSON scalar within int64 and finite; raises :class:`options.KvOptionsError`."""
    for key, value in fields.items():
        if value is not None and not isinstance(value, (str, int, float, bool)):
            kind = type(value).__name__
            raise options.KvOptionsError(key, f"must be a scalar, got {kind}", value)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
            raise options.KvOptionsError(key, "out of range", value)
        if isinstance(value, float) and not math.isfinite(value):
            raise options.KvOptionsError(key, "must be finite", value)


def prevalidate(merged: Mapping[str, Any]) -> None:
    """Every check that does not need the prompt; raises :class:`options.KvOptionsError`."""
    check_scalars(merged)
    # A fraction is checked against the longest prompt here; per prompt in the input processor.
    options.parse_kv_options(merged, num_prompt_tokens=1 << 30)


def _reject(exc: options.KvOptionsError):
    from vllm.exceptions import VLLMValidationError

    from obcache_vllm.vllm_ext.frontend.stats import count_rejection

    count_rejection(exc.field)
    return VLLMValidationError(str(exc), parameter=exc.field, value=exc.shown_value)


def check_rendered_prompt(serving, inputs, extra_args: Mapping[str, Any]) -> None:
    """The checks of ``support.check_request`` on one rendered prompt of a generate handler.

    Raises:
        options.KvOptionsError: a bad option, or a budget this engine or request cannot serve.
    """
    components = serving._extract_prompt_components(inputs)
    token_ids, embeds = components.token_ids, components.embeds
    if token_ids is not None:
        num_prompt = len(token_ids)
    else:
        num_prompt = len(embeds) if embeds is not None else 0
    vllm_config = getattr(getattr(serving, "engine_client", None), "vllm_config", None)
    if vllm_config is None:  # not a generate handler of AsyncLLM: the prompt checks only
        options.parse_kv_options(extra_args, num_prompt, serving.model_config.max_model_len)
        return
    support.check_request(vllm_config, extra_args, num_prompt, prompt_embeds=embeds is not None)


def _wrap_log_inputs(original):
    @functools.wraps(original)
    def _log_inputs(self, request_id, inputs, *args, **kwargs):
        params = kwargs["params"] if "params" in kwargs else (args[0] if args else None)
        extra = getattr(params, "extra_args", None)  # None for beam search and pooling
        if extra and any(is_kv_option(k) for k in extra):
            try:
                check_rendered_prompt(self, inputs, extra)
            except options.KvOptionsError as exc:
                raise _reject(exc) from exc
        _check_capacity(self, inputs, params)
        return original(self, request_id, inputs, *args, **kwargs)

    _log_inputs.__obcache_wrapped__ = True
    return _log_inputs


def _check_capacity(serving, inputs, params) -> None:
    """A request that can never fit the KV pool: 400 before any stream starts (see
    :mod:`obcache_vllm.vllm_ext.frontend.capacity`; a no-op when the pool holds
    ``max_model_len``)."""
    from obcache_vllm.vllm_ext.frontend.capacity import capacity_error

    vllm_config = getattr(getattr(serving, "engine_client", None), "vllm_config", None)
    if vllm_config is None or not hasattr(params, "max_tokens"):
        return
    token_ids = serving._extract_prompt_components(inputs).token_ids
    if token_ids is None:
        return
    try:
        opts = options.parse_kv_options(params.extra_args, len(token_ids))
    except options.KvOptionsError:
        return  # reported by the checks above or by the input processor
    error = capacity_error(vllm_config, len(token_ids), params.max_tokens, opts)
    if error is not None:
        raise _reject(error)


def _wrap_to_sampling_params(original):
    @functools.wraps(original)
    def to_sampling_params(self, *args, **kwargs):
        requested = requested_kv_fields(self.vllm_xargs, self.model_extra)
        merged = config.merge_request(server_defaults(), requested)
        try:
            # Before vLLM's own checks: its range check of extra_args would reject an int
            # beyond 64 bits in vllm_xargs as "extra_args", without naming the kv_* field.
            check_scalars(requested_kv_fields(self.vllm_xargs, None))
            prevalidate(merged)
        except options.KvOptionsError as exc:
            raise _reject(exc) from exc
        params = original(self, *args, **kwargs)
        extra = {k: v for k, v in (params.extra_args or {}).items() if not is_kv_option(k)}
        extra.update(merged)
        params.extra_args = extra or None
        return params

    to_sampling_params.__obcache_wrapped__ = True
    return to_sampling_params


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
    from obcache_vllm.scoring import PIPELINE_NAMES, SCORER_NAMES

    return {
        "scorers": list(SCORER_NAMES),
        "pipelines": list(PIPELINE_NAMES),
        "request_fields": list(options.WIRE_FIELDS),
        "defaults": dict(server_defaults()),
        "usage_field": f"usage.{USAGE_KEY}",
    }


async def obcache_config_endpoint():
    from fastapi.responses import JSONResponse

    return JSONResponse(config_document())


def _wrap_register_api_routers(original):
    @functools.wraps(original)
    def register_api_routers(args, app, *rest, **kwargs):
        result = original(args, app, *rest, **kwargs)
        app.add_api_route(CONFIG_ROUTE, obcache_config_endpoint, methods=["GET"])
        return result

    register_api_routers.__obcache_wrapped__ = True
    return register_api_routers



def install_server() -> None:
    """Apply the API-server patches (idempotent). Loads and validates the server defaults.

    Raises:
        obcache_vllm.config.ConfigError: invalid kv_* defaults (the server does not start).
    """
    server_defaults()
    from vllm.entrypoints.launchers import app as app_module
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.serve.engine.serving import BaseServing

    patch_method(BaseServing, "_log_inputs", _wrap_log_inputs)
    patch_method(ChatCompletionRequest, "to_sampling_params", _wrap_to_sampling_params)
    patch_method(CompletionRequest, "to_sampling_params", _wrap_to_sampling_params)
    patch_method(OpenAIServingChat, "chat_completion_full_generator", _wrap_full_generator)
    patch_method(
        OpenAIServingChat,
        "chat_completion_stream_generator",
        lambda f: _wrap_stream_generator(f, 1),
    )
    patch_method(
        OpenAIServingCompletion,
        "completion_stream_generator",
        lambda f: _wrap_stream_generator(f, 2),
    )
    patch_method(
        OpenAIServingCompletion,
        "request_output_to_completion_response",
        _wrap_completion_response,
    )
    patch_method(app_module, "register_api_routers", _wrap_register_api_routers)
