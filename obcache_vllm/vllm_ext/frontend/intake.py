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

The server's steps leave their stage objects in ``extra_args`` under keys of their own, one
type each (``admission.REQUESTED_KEY``: a ``Requested``; ``admission.CHECKED_KEY``: an
``Admitted``); this step takes them off and writes the wire tuple under ``"obcache"``, which
holds nothing else. Only admission makes them, so a client cannot send one (the keys are
reserved, and anything else under them from outside is refused). The server policy is passed
to the parse, never stamped on the client's request. Each engine's
:class:`~obcache_vllm.admission.Admission` (its configuration, the platform's declared
capabilities, its index of recent prompts) is built once, on its input processor
(:func:`admission_of`). This module imports neither the server nor the stat logger (an
import-linter contract): the stat logger hands it its rejection counter
(:func:`count_rejections_with`).
"""

from __future__ import annotations

from collections.abc import Callable

from obcache_vllm.admission import Admission, Prompt
from obcache_vllm.options import KvOptionsError
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
    """What admission reads of vLLM's engine request's prompt."""
    token_ids, embeds = engine_request.prompt_token_ids, engine_request.prompt_embeds
    length = len(token_ids) if token_ids is not None else len(embeds) if embeds is not None else 0
    return Prompt(length, embeds is not None, token_ids,
                  max_tokens=engine_request.sampling_params.max_tokens,
                  cache_salt=engine_request.cache_salt,
                  lora_name=getattr(engine_request.lora_request, "lora_name", None))  # fmt: skip


def admit_engine_request(gate: Admission, engine_request) -> None:
    """The input processor's step: the request leaves the front end with its wire form
    (:meth:`~obcache_vllm.admission.Admission.engine_extra_args` decides it).

    The request's ``sampling_params`` is the input processor's own copy: its ``extra_args``
    is replaced, never mutated (the caller's params may be shared across prompts).

    Raises:
        vllm.exceptions.VLLMValidationError: through :func:`rejected`.
    """
    params = engine_request.sampling_params
    if params is None:
        return
    extra = params.extra_args or {}
    try:
        new = gate.engine_extra_args(
            extra, _prompt(engine_request), kv_hints=getattr(engine_request, "kv_hints", None),
            session_id=getattr(engine_request, "session_id", None),
            resumable=bool(getattr(engine_request, "resumable", False)),
        )  # fmt: skip
    except KvOptionsError as exc:
        raise rejected(exc) from exc
    if new is not extra:
        params.extra_args = new or None
