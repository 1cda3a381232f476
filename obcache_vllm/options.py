"""Per-request KV-eviction options: parsed once, at the edge, into a frozen validated object.

Wire format (strings exist only here): the keys below, in ``SamplingParams.extra_args`` (the
OpenAI API's ``vllm_xargs`` lands there; the server also lifts them from top-level request
fields). A request without ``kv_budget`` is a stock vLLM request: :func:`parse_kv_options`
returns ``None`` and nothing else in obcache-vllm touches it.

==============  =========================================================================
key             meaning
==============  =========================================================================
kv_budget       int >= 1: resident KV tokens per layer and KV head after eviction;
                float in (0, 1]: that fraction of the prompt (rounded up).
kv_scorer       token score (see ``obcache_vllm.scoring.SCORER_NAMES``)
kv_pipeline     selection pipeline (see ``obcache_vllm.scoring.PIPELINE_NAMES``)
kv_window       observation window (last prompt queries) for ``snapkv``; default 64
kv_recent       most recent tokens always kept; default 16
kv_sinks        first tokens always kept (attention sinks); default 4
kv_decode       also evict during decoding (running scores); default false. Booleans are
                true/false, "true"/"false" or 1/0 (``vllm_xargs`` turns JSON booleans
                into integers)
kv_compress_at  int k in [1, prompt length]: evict once the first k prompt tokens are cached,
                scored with queries from those k only; the rest of the prompt (e.g. the
                question) is prefilled on the compressed cache ("query-agnostic"). A fractional
                kv_budget is then a fraction of k. Default: the whole prompt.
kv_per_head     true: each KV head keeps its own top tokens; false: one ranking per layer
                (scores summed over heads, as kvpress's presses do); default true
kv_prefill_evict
                also evict after every prefill chunk that leaves a whole block over budget,
                so the prompt never holds more than budget + one chunk (+ one block): a
                prompt longer than the KV pool can be served. Each chunk's eviction is scored
                with the queries prefilled so far (as ``kv_compress_at`` at that chunk's end).
                Default false
==============  =========================================================================

Budget rule (see :mod:`obcache_vllm.eviction.planning`): eviction frees whole KV blocks only, so the
kept count K of a compressed request satisfies ``budget <= K < budget + block_size``.

Every error is a :class:`KvOptionsError` naming the offending wire field; the vLLM edge turns
it into ``VLLMValidationError`` (HTTP 400) before anything is allocated for the request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

WIRE_FIELDS = (
    "kv_budget",
    "kv_scorer",
    "kv_pipeline",
    "kv_window",
    "kv_recent",
    "kv_sinks",
    "kv_decode",
    "kv_compress_at",
    "kv_per_head",
    "kv_prefill_evict",
)

# kv_-prefixed extra_args keys that belong to vLLM, not to us (KV-connector transfer params).
FOREIGN_KV_KEYS = ("kv_transfer_params",)

DEFAULT_SCORER = "obcache_key"
DEFAULT_PIPELINE = "snapkv"
DEFAULT_WINDOW = 64
DEFAULT_RECENT = 16
DEFAULT_SINKS = 4


class KvOptionsError(ValueError):
    """A kv_* request option is invalid. ``field`` is the wire name (e.g. ``kv_budget``)."""

    def __init__(self, field: str, message: str, value: Any = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.value = value

    @property
    def shown_value(self) -> Any:
        """The value, or a bounded repr of it: error responses never echo a huge input."""
        return bounded(self.value)


_SHOWN_CHARS = 80


def bounded(value: Any) -> Any:
    """``value`` if its repr is short, else the start of the repr and its full length."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARS:
        return value
    return f"{text[:_SHOWN_CHARS]}... ({len(text)} chars)"


@dataclass(frozen=True)
class KvOptions:
    """Validated eviction options of one request.

    ``budget`` is the resolved token budget (a ratio is already applied to the prompt length).
    """

    budget: int
    scorer: str = DEFAULT_SCORER
    pipeline: str = DEFAULT_PIPELINE
    window: int = DEFAULT_WINDOW
    recent: int = DEFAULT_RECENT
    sinks: int = DEFAULT_SINKS
    decode: bool = False
    # Prompt tokens cached when eviction runs (None: the whole prompt).
    compress_at: int | None = None
    per_head: bool = True
    prefill_evict: bool = False

    def compress_point(self, num_prompt_tokens: int) -> int:
        """Number of prompt tokens in the cache when the prefill eviction runs."""
        return num_prompt_tokens if self.compress_at is None else self.compress_at

    def build_scoring(self):
        """``(scorer, pipeline)`` objects for these options; the one place they are built.

        The vLLM worker and the HF reference both call this, so they score identically.
        """
        from obcache_vllm.scoring import make_pipeline, make_scorer

        kwargs = {"window": self.window} if self.pipeline == "snapkv" else {}
        pipeline = make_pipeline(self.pipeline, per_head=self.per_head, **kwargs)
        return make_scorer(self.scorer), pipeline

    @property
    def query_window(self) -> int:
        """How many of the last prompt queries the prefill score needs (0: none, -1: all)."""
        if self.pipeline == "snapkv":
            return self.window
        if self.pipeline == "tova":
            return 1
        if self.pipeline == "h2o":
            return -1
        return 0


def _known_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    from obcache_vllm.scoring import PIPELINE_NAMES, SCORER_NAMES

    return tuple(SCORER_NAMES), tuple(PIPELINE_NAMES)


def _int_field(raw: Mapping[str, Any], field: str, default: int, minimum: int) -> int:
    value = raw.get(field, default)
    # bool is an int subclass; "true" as a window is a client bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise KvOptionsError(field, f"must be an integer >= {minimum}", value)
    if value < minimum:
        raise KvOptionsError(field, f"must be an integer >= {minimum}", value)
    return value


def _name_field(raw: Mapping[str, Any], field: str, default: str, known: tuple[str, ...]) -> str:
    value = raw.get(field, default)
    if not isinstance(value, str) or value not in known:
        shown = bounded(value)
        shown = repr(value) if shown is value else shown
        raise KvOptionsError(field, f"unknown name {shown}; known: {', '.join(known)}", value)
    return value


def _bool_field(raw: Mapping[str, Any], field: str, default: bool) -> bool:
    value = raw.get(field, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    # vLLM's vllm_xargs model (values str | int | float | list) turns a JSON true into 1.
    if type(value) is int and value in (0, 1):
        return value == 1
    raise KvOptionsError(field, "must be a boolean", value)


def _resolve_budget(value: Any, num_prompt_tokens: int) -> int:
    field = "kv_budget"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KvOptionsError(field, "must be an integer >= 1 or a fraction in (0, 1]", value)
    if isinstance(value, float) and not math.isfinite(value):
        raise KvOptionsError(field, "must be finite", value)
    if isinstance(value, int):
        if value < 1:
            raise KvOptionsError(field, "must be an integer >= 1 or a fraction in (0, 1]", value)
        return value
    if value.is_integer() and value > 1:
        return int(value)
    if not 0.0 < value <= 1.0:
        raise KvOptionsError(field, "a fractional budget must lie in (0, 1]", value)
    return max(1, math.ceil(value * num_prompt_tokens))


def parse_kv_options(
    extra_args: Mapping[str, Any] | None,
    num_prompt_tokens: int,
    max_model_len: int | None = None,
) -> KvOptions | None:
    """Parse and validate the kv_* options of one request; ``None`` if it has no budget.

    Deterministic and side-effect free, so the front-end (validation), the scheduler and the
    worker each call it on the same ``extra_args`` and agree on the result.

    Raises:
        KvOptionsError: an unknown ``kv_*`` key, or a value out of its domain.
    """
    raw = dict(extra_args or {})
    unknown = sorted(
        k
        for k in raw
        if k.startswith("kv_") and k not in WIRE_FIELDS and k not in FOREIGN_KV_KEYS
    )
    if unknown:
        raise KvOptionsError(
            unknown[0], f"unknown option; known: {', '.join(WIRE_FIELDS)}", raw[unknown[0]]
        )
    if raw.get("kv_budget") is None:
        others = [k for k in WIRE_FIELDS if k in raw and raw[k] is not None]
        if others:
            raise KvOptionsError(others[0], "requires kv_budget", raw[others[0]])
        return None
    scorers, pipelines = _known_names()
    compress_at = None
    if raw.get("kv_compress_at") is not None:
        compress_at = _int_field(raw, "kv_compress_at", 0, 1)
        if compress_at > num_prompt_tokens:
            raise KvOptionsError(
                "kv_compress_at",
                f"{compress_at} exceeds the prompt length {num_prompt_tokens}",
                compress_at,
            )
    budget = _resolve_budget(raw["kv_budget"], compress_at or num_prompt_tokens)
    if max_model_len is not None and budget > max_model_len:
        raise KvOptionsError(
            "kv_budget",
            f"{bounded(budget)} exceeds the model context length {max_model_len}",
            budget,
        )
    opts = KvOptions(
        budget=budget,
        scorer=_name_field(raw, "kv_scorer", DEFAULT_SCORER, scorers),
        pipeline=_name_field(raw, "kv_pipeline", DEFAULT_PIPELINE, pipelines),
        window=_int_field(raw, "kv_window", DEFAULT_WINDOW, 1),
        recent=_int_field(raw, "kv_recent", DEFAULT_RECENT, 0),
        sinks=_int_field(raw, "kv_sinks", DEFAULT_SINKS, 0),
        decode=_bool_field(raw, "kv_decode", False),
        compress_at=compress_at,
        per_head=_bool_field(raw, "kv_per_head", True),
        prefill_evict=_bool_field(raw, "kv_prefill_evict", False),
    )
    if max_model_len is not None and opts.window > max_model_len:
        raise KvOptionsError(
            "kv_window",
            f"{bounded(opts.window)} exceeds the model context length {max_model_len}",
            opts.window,
        )
    if opts.sinks + opts.recent >= opts.budget:
        raise KvOptionsError(
            "kv_budget",
            f"budget {opts.budget} must exceed kv_sinks + kv_recent = {opts.sinks + opts.recent}",
            opts.budget,
        )
    return opts


def parse_validated_kv_options(
    extra_args: Mapping[str, Any] | None,
    num_prompt_tokens: int,
    max_model_len: int | None = None,
) -> KvOptions | None:
    """:func:`parse_kv_options` for code behind the front-end's validation (scheduler, worker).

    Requests are validated before they reach the engine; one that was not (e.g. a pre-built
    ``EngineCoreRequest``) and is invalid is served as a stock request rather than crashing the
    engine. Deterministic, so scheduler and worker still agree.
    """
    try:
        return parse_kv_options(extra_args, num_prompt_tokens, max_model_len)
    except KvOptionsError as exc:
        import logging

        logging.getLogger(__name__).error(
            "ignoring invalid kv options (%s); serving unbudgeted", exc
        )
        return None
