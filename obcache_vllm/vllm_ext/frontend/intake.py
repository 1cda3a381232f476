"""The input processor's seam: every request leaves the front end through here, admitted.

Decisions are :mod:`obcache_vllm.admission`'s; this module reads vLLM's objects into its terms
and back, and turns a refusal into vLLM's ``VLLMValidationError`` (HTTP 400), counted by field
(:func:`rejected`). Where each step runs (API-server process; the offline ``LLM``'s own
process)::

  HTTP body ─ to_sampling_params (server.py) ─ admission.parse(fields, policy) ─▶ Requested
  rendered prompt ─ AsyncLLM.generate (server.py) ─ Admission.admit ─▶ Admitted
  InputProcessor.process_inputs ─ admit_engine_request ─▶ the wire tuple (KvOptions.to_wire)
      (offline LLM, engine API: raw kv_* extra_args and kv_hints are parsed and admitted
      here, in one step)
                                  │
  EngineCore (scheduler) and worker: KvOptions.from_wire, never re-validated; a request with
  kv_* fields but no (or a broken) wire form is a counted fault there, never silently stock.

``extra_args["obcache"]`` holds the front end's stage objects (``Requested`` from the server's
parse, ``Admitted`` from its prompt check) until this step replaces them by the wire tuple;
only admission makes them, so a client cannot send one (anything else under that key from
outside is refused). The server policy is passed to the parse, never stamped on the client's
request. Each engine's :class:`~obcache_vllm.admission.Admission` (its configuration, the
platform's declared capabilities, its index of recent prompts) is built once, on its input
processor (:func:`admission_of`). This module imports neither the server nor the stat logger
(an import-linter contract): the stat logger hands it its rejection counter
(:func:`count_rejections_with`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from obcache_vllm import admission
from obcache_vllm.admission import Admission, Admitted, Prompt
from obcache_vllm.options import ADMITTED_KEY, KvOptionsError, is_kv_option
from obcache_vllm.vllm_ext.seams import platform_backend

# Counts a refusal by field: set by the live Prometheus logger (frontend/stats.py), which
# imports this module; None without one (the offline LLM).
_count_rejection: Callable[[str], None] | None = None

ATTRIBUTE = "obcache_admission"  # where an input processor keeps its engine's Admission


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


def admission_of(processor) -> Admission:
    """The :class:`~obcache_vllm.admission.Admission` of the engine this input processor
    feeds: built on first use from its configuration and this platform's adapter, then kept
    on the processor (one per engine, as the engine's own state is)."""
    found = processor.__dict__.get(ATTRIBUTE)
    if found is None:
        found = Admission.for_engine(processor.vllm_config, platform_backend())
        processor.__dict__[ATTRIBUTE] = found
    return found


def _prompt(engine_request) -> Prompt:
    token_ids, embeds = engine_request.prompt_token_ids, engine_request.prompt_embeds
    length = len(token_ids) if token_ids is not None else len(embeds) if embeds is not None else 0
    params = engine_request.sampling_params
    seed = admission.prompt_seed(engine_request.cache_salt, engine_request.lora_request)
    return Prompt(length, embeds is not None, token_ids, seed, params.max_tokens)


def admit_engine_request(gate: Admission, engine_request) -> None:
    """The input processor's step: the request leaves the front end with its wire form.

    * :class:`~obcache_vllm.admission.Admitted` (the server admitted it on the rendered
      prompt): encoded as is, or joined to the vLLM ``session_id`` the request carries.
    * :class:`~obcache_vllm.admission.Requested` (parsed by the server, not admitted yet):
      admitted here.
    * raw ``kv_*`` extra_args (offline ``LLM``, the engine API): parsed and admitted here.
    * anything else under the reserved key: refused.
    * no options: a stock request; only the pool's size can refuse it.

    The engine API's ``kv_hints`` (:func:`~obcache_vllm.admission.hinted_fields`) give a
    request kv_* fields an orchestrator chose: the request's own kv_* ``extra_args`` win field
    by field, the hint fills in the rest (a request the server already parsed or admitted
    keeps its own).

    The request's ``sampling_params`` is the input processor's own copy: its ``extra_args``
    is replaced, never mutated (the caller's params may be shared across prompts).

    Raises:
        vllm.exceptions.VLLMValidationError: through :func:`rejected`.
    """
    params = engine_request.sampling_params
    if params is None:
        return
    try:
        extra_args = _admitted_extra_args(gate, engine_request, params.extra_args or {})
    except KvOptionsError as exc:
        raise rejected(exc) from exc
    if extra_args is not _UNCHANGED:
        params.extra_args = extra_args or None


_UNCHANGED = object()


def _admitted_extra_args(gate: Admission, engine_request, extra: dict[str, Any]):
    """The request's new ``extra_args`` (:data:`_UNCHANGED`: as they are)."""
    value = extra.get(ADMITTED_KEY)
    kv_hints = getattr(engine_request, "kv_hints", None)
    hints = admission.hinted_fields(kv_hints) if value is None else {}
    if value is None and not hints and not any(is_kv_option(k) for k in extra):
        has_prompt = (engine_request.prompt_token_ids is not None
                      or engine_request.prompt_embeds is not None)  # fmt: skip
        if has_prompt and admission.pool_is_short(gate.vllm_config):
            prompt = _prompt(engine_request)
            admission.check_fits(gate.vllm_config, prompt.length, prompt.max_tokens, None)
        return _UNCHANGED
    rest = {k: v for k, v in extra.items() if not is_kv_option(k) and k != ADMITTED_KEY}
    prompt = _prompt(engine_request)
    admission.refuse_foreign(value)
    if isinstance(value, Admitted):
        admitted = value
    else:
        own = {k: v for k, v in extra.items() if is_kv_option(k)}
        requested = value if value is not None else admission.parse({**hints, **own})
        if requested is None:  # "kv_budget": null: a stock request, its fields dropped
            return rest
        admitted = gate.admit(requested, prompt)
    if admitted is not None and getattr(engine_request, "resumable", False):
        admitted = gate.streaming(admitted)
    if admitted is None:  # the policy's budget does not apply: a stock request
        return rest
    admitted = gate.join_session(admitted, getattr(engine_request, "session_id", None), prompt)
    return {**rest, ADMITTED_KEY: admitted.options.to_wire()}
