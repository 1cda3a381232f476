"""Per-request KV-eviction options: parsed once at the edge, resolved once, carried as a wire form.

Three shapes, one direction (the front end makes the first two, every later process decodes
the third; see :mod:`obcache_vllm.vllm_ext.frontend.admission` for where each step runs)::

    request fields (strings, JSON)  --parse_request-->  KvRequest   what the client asked
    KvRequest      --resolve(prompt length, context)-->  KvOptions   what this request gets
    KvOptions      --to_wire / from_wire-->  a versioned tuple of primitives in
                   SamplingParams.extra_args["obcache"], decoded by EngineCore and the worker

A request without ``kv_budget`` is a stock vLLM request: :func:`parse_request` returns ``None``
and nothing else in obcache-vllm touches it.

==============  =========================================================================
field           meaning
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
                kv_budget is then a fraction of k. ``"auto"``: a prompt that continues a recent
                ``"auto"`` prompt (a chat's next turn) is served as ``kv_session``; else k is
                the longest prefix (whole blocks, at least half the prompt) it shares with a
                recent one, else the whole prompt, as a tentative ``kv_session`` (its final
                cache is kept for a next turn while the pool has room;
                ``obcache_vllm.eviction.sightings``); the server policy's default. Default: the
                whole prompt.
kv_per_head     true: each KV head keeps its own top tokens; false: one ranking per layer
                (scores summed over heads, as kvpress's presses do); default true
kv_prefill_evict
                also evict after every prefill chunk that leaves a whole block over budget,
                so the prompt never holds more than budget + one chunk (+ one block): a
                prompt longer than the KV pool can be served. Each chunk's eviction is scored
                with the queries prefilled so far (as ``kv_compress_at`` at that chunk's end).
                Default false
kv_session      true: continue from the compressed cache an earlier ``kv_session`` request
                left behind, if its tokens (prompt and output, as cached) are exactly a
                prefix of this prompt and its options and cache salt are the same; leave this
                request's final cache for the next turn. Not with h2o (its running sums
                would have to travel with the cache), ``kv_compress_at`` or
                ``kv_prefill_evict``. Default false
kv_when         "always": evict as the options say (the default); "pressure": run exactly as
                stock vLLM while the KV pool has room, and compress to the budget only when
                the scheduler would otherwise preempt a running request or leave a waiting one
                unadmitted for lack of blocks (then as the options say). Not with h2o,
                ``kv_compress_at``, ``kv_prefill_evict`` or ``kv_session``
==============  =========================================================================

Budget rule (see :mod:`obcache_vllm.eviction.planning`): eviction frees whole KV blocks only,
so the kept count K of a compressed request satisfies ``budget <= K < budget + block_size``.

Every error is a :class:`KvOptionsError` naming the offending field; the front end turns it
into vLLM's ``VLLMValidationError`` (HTTP 400) before anything is allocated for the request.
Plain Python: no vLLM import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
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
    "kv_session",
    "kv_when",
)

# kv_-prefixed extra_args keys that belong to vLLM, not to us (KV-connector transfer params).
FOREIGN_KV_KEYS = ("kv_transfer_params",)

# The extra_args key of the admitted options: an in-process object between the front end's
# steps, the wire tuple once the request leaves the input processor. Reserved: a client that
# sends it in vllm_xargs gets a 400.
ADMITTED_KEY = "obcache"
WIRE_VERSION = "obcache/1"

DEFAULT_SCORER = "obcache_key"
DEFAULT_PIPELINE = "snapkv"
DEFAULT_WINDOW = 64
DEFAULT_RECENT = 16
DEFAULT_SINKS = 4
WHEN = ("always", "pressure")
# kv_compress_at's one non-integer value: the front end chooses k from the prompts it has seen.
AUTO = "auto"


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


class WireError(ValueError):
    """An admitted-options wire form that does not decode (a fault, never a client error)."""


_SHOWN_CHARS = 80


def bounded(value: Any) -> Any:
    """``value`` if its repr is short, else the start of the repr and its full length."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARS:
        return value
    return f"{text[:_SHOWN_CHARS]}... ({len(text)} chars)"


def is_kv_option(key: str) -> bool:
    """A kv_* request option (``kv_transfer_params`` is vLLM's own field, not ours)."""
    return key.startswith("kv_") and key not in FOREIGN_KV_KEYS


@dataclass(frozen=True)
class KvOptions:
    """The resolved eviction options of one request (frozen; what EngineCore and worker see).

    ``budget`` is the resolved token budget (a ratio is already applied to the prompt length);
    ``requested_budget`` is what the client asked for (an int, or the fraction).
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
    session: bool = False
    when: str = "always"
    requested_budget: int | float | None = field(default=None, compare=False)
    # A session the front end started on its own (``kv_compress_at: "auto"`` on a prompt that
    # continues nothing): its entry is held only while no request needs the blocks.
    tentative: bool = False

    def compress_point(self, num_prompt_tokens: int) -> int:
        """Number of prompt tokens in the cache when the prefill eviction runs."""
        return num_prompt_tokens if self.compress_at is None else self.compress_at

    def build_scoring(self):
        """``(scorer, pipeline)`` objects for these options; the one place they are built.

        The vLLM worker and the HF reference both call this, so they score identically.
        """
        from obcache_vllm.scoring import make_scorer

        return make_scorer(self.scorer), self._pipeline

    @functools.cached_property
    def _pipeline(self):
        """The pipeline object (its class says which options it takes; built once)."""
        from obcache_vllm.scoring import make_pipeline, pipeline_class

        kwargs = {name: getattr(self, name) for name in pipeline_class(self.pipeline).takes_options}
        return make_pipeline(self.pipeline, per_head=self.per_head, **kwargs)

    @property
    def query_window(self) -> int:
        """How many of the last prompt queries the prefill score needs (0: none, -1: all),
        as the pipeline declares (its ``window``; None: every query)."""
        window = self._pipeline.window
        return -1 if window is None else window

    # -- the wire form: a versioned tuple of primitives (msgspec and pickle carry it) ------
    def to_wire(self) -> tuple:
        return (WIRE_VERSION, *(getattr(self, f.name) for f in _OPTION_FIELDS))

    @classmethod
    def from_wire(cls, value: Any) -> KvOptions:
        """Decode :meth:`to_wire`'s tuple (a list after msgspec); raises :class:`WireError`.

        Checks shape and primitive types only: the values were validated at admission.
        """
        if not isinstance(value, (tuple, list)) or not value or value[0] != WIRE_VERSION:
            raise WireError(f"not an {WIRE_VERSION} wire form: {bounded(value)!r}")
        if len(value) != len(_OPTION_FIELDS) + 1:
            raise WireError(f"{WIRE_VERSION} wire form of {len(value)} items: {bounded(value)!r}")
        values = dict(zip((f.name for f in _OPTION_FIELDS), value[1:], strict=True))
        for name, kinds in _WIRE_TYPES.items():
            item = values[name]
            if not isinstance(item, kinds) or (isinstance(item, bool) and bool not in kinds):
                raise WireError(f"{WIRE_VERSION} wire field {name}={bounded(item)!r}")
        return cls(**values)


_OPTION_FIELDS = fields(KvOptions)
_WIRE_TYPES: dict[str, tuple[type, ...]] = {
    "budget": (int,),
    "scorer": (str,),
    "pipeline": (str,),
    "window": (int,),
    "recent": (int,),
    "sinks": (int,),
    "decode": (bool,),
    "compress_at": (int, type(None)),
    "per_head": (bool,),
    "prefill_evict": (bool,),
    "session": (bool,),
    "when": (str,),
    "requested_budget": (int, float, type(None)),
    "tentative": (bool,),
}
assert tuple(_WIRE_TYPES) == tuple(f.name for f in _OPTION_FIELDS)


@dataclass(frozen=True)
class KvRequest:
    """What one request asked for: every kv_* field parsed and checked, the prompt not yet known.

    :meth:`resolve` applies it to a prompt (a fraction becomes tokens, positions are checked
    against the prompt and the context) and returns the :class:`KvOptions` it gets.
    """

    budget: int | float
    scorer: str = DEFAULT_SCORER
    pipeline: str = DEFAULT_PIPELINE
    window: int = DEFAULT_WINDOW
    recent: int = DEFAULT_RECENT
    sinks: int = DEFAULT_SINKS
    decode: bool = False
    compress_at: int | str | None = None  # a position, AUTO, or None (the whole prompt)
    per_head: bool = True
    prefill_evict: bool = False
    session: bool = False
    when: str = "always"
    # Not None: the budget is the server policy's (the request set none), for prompts of at
    # least this many tokens (see obcache_vllm.config); admission may then waive it.
    policy_min_prompt_tokens: int | None = None

    def resolve(
        self,
        num_prompt_tokens: int,
        max_model_len: int | None = None,
        auto_point: int | None = None,
        auto_session: bool = False,
        session_id: str | None = None,
    ) -> KvOptions:
        """The options of this request on a prompt of ``num_prompt_tokens`` tokens.

        ``auto_point``: for ``kv_compress_at: "auto"``, the point the front end chose from the
        prompts it has seen (None: the whole prompt); taken only where its budget leaves room
        beyond the sinks and recent tokens, else the whole prompt. ``auto_session``: the prompt
        continues a recent one (a chat's next turn): it is served as ``kv_session`` instead,
        where its options allow a session (:meth:`joins_session`). A whole-prompt ``"auto"``
        request whose options allow one is a *tentative* session (``KvOptions.tentative``):
        it may be a chat's first turn, so its final cache is left for a next turn, held only
        while the pool has room to spare. ``session_id``: vLLM's own session id of the
        request (body, ``X-Session-ID`` header or ``vllm_xargs``): the request takes part in
        that session, as with ``kv_session`` (see :meth:`joins_session`).

        Raises:
            KvOptionsError: ``kv_compress_at`` past the prompt, a budget or window beyond the
                context, or a budget that leaves no room beyond the sinks and recent tokens.
        """
        if session_id and self.joins_session():
            joined = dataclasses.replace(self, compress_at=None, session=True)
            return joined.resolve(num_prompt_tokens, max_model_len)
        if self.compress_at == AUTO:
            if auto_session and not _sums_every_query(self.pipeline):
                continued = dataclasses.replace(self, compress_at=None, session=True)
                return continued.resolve(num_prompt_tokens, max_model_len)
            point = auto_point
            if point is not None and (point >= num_prompt_tokens or not self._room_at(point)):
                point = None
            if point is None and self.joins_session():
                # Compressed whole, as a tentative session: it may be a chat's first turn.
                first = dataclasses.replace(self, compress_at=None, session=True)
                resolved = first.resolve(num_prompt_tokens, max_model_len)
                return dataclasses.replace(resolved, tentative=True)
            return dataclasses.replace(self, compress_at=point).resolve(
                num_prompt_tokens, max_model_len
            )
        if self.compress_at is not None and self.compress_at > num_prompt_tokens:
            raise KvOptionsError(
                "kv_compress_at",
                f"{self.compress_at} exceeds the prompt length {num_prompt_tokens}",
                self.compress_at,
            )
        base = self.compress_at or num_prompt_tokens
        budget = self.budget
        if not isinstance(budget, int):
            budget = max(1, math.ceil(budget * base))
        if max_model_len is not None and budget > max_model_len:
            raise KvOptionsError(
                "kv_budget",
                f"{bounded(budget)} exceeds the model context length {max_model_len}",
                budget,
            )
        if max_model_len is not None and self.window > max_model_len:
            raise KvOptionsError(
                "kv_window",
                f"{bounded(self.window)} exceeds the model context length {max_model_len}",
                self.window,
            )
        _check_room(budget, self.sinks, self.recent)
        return KvOptions(
            budget=budget,
            scorer=self.scorer,
            pipeline=self.pipeline,
            window=self.window,
            recent=self.recent,
            sinks=self.sinks,
            decode=self.decode,
            compress_at=self.compress_at,
            per_head=self.per_head,
            prefill_evict=self.prefill_evict,
            session=self.session,
            when=self.when,
            requested_budget=self.budget,
        )


    def joins_session(self) -> bool:
        """Whether a vLLM ``session_id`` on this request makes it a ``kv_session`` request:
        where its options allow a session (no position of its own in ``kv_compress_at``, no
        ``kv_prefill_evict``, ``kv_when: always``, a pipeline whose state fits in the cache).
        Elsewhere the id is vLLM's alone (routing, KV events) and the options stand."""
        return (
            not self.session
            and self.compress_at in (None, AUTO)
            and not self.prefill_evict
            and self.when == "always"
            and not _sums_every_query(self.pipeline)
        )

    def _room_at(self, point: int) -> bool:
        """Whether compressing the first ``point`` tokens to this budget leaves room beyond
        the sinks and recent tokens and evicts something."""
        budget = self.budget
        if not isinstance(budget, int):
            budget = max(1, math.ceil(budget * point))
        return self.sinks + self.recent < budget < point


def _check_room(budget: int, sinks: int, recent: int) -> None:
    if sinks + recent >= budget:
        raise KvOptionsError(
            "kv_budget",
            f"budget {budget} must exceed kv_sinks + kv_recent = {sinks + recent}",
            budget,
        )


def _without_running_sums() -> str:
    from obcache_vllm.scoring import pipeline_class, pipeline_names

    names = [n for n in pipeline_names() if not pipeline_class(n).sums_every_query]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def _sums_every_query(pipeline: str) -> bool:
    from obcache_vllm.scoring import pipeline_class

    return pipeline_class(pipeline).sums_every_query


def _check_session(request: KvRequest) -> None:
    """What a continued cache cannot carry (see ``kv_session`` above)."""
    if _sums_every_query(request.pipeline):
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


def _check_pressure(request: KvRequest) -> None:
    """What compression under pressure cannot do (see ``kv_when`` above)."""
    if _sums_every_query(request.pipeline):
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


def _known_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    from obcache_vllm.scoring import SCORER_NAMES, pipeline_names

    return tuple(SCORER_NAMES), pipeline_names()


def _check_scalar(key: str, value: Any) -> None:
    """A JSON scalar, an int within int64, a finite float (vLLM's transport carries int64)."""
    if value is not None and not isinstance(value, (str, int, float, bool)):
        raise KvOptionsError(key, f"must be a scalar, got {type(value).__name__}", value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        raise KvOptionsError(key, "out of range", value)
    if isinstance(value, float) and not math.isfinite(value):
        raise KvOptionsError(key, "must be finite", value)


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


def _budget_field(value: Any) -> int | float:
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
    return value


def parse_request(
    raw: Mapping[str, Any] | None, policy_min_prompt_tokens: int | None = None
) -> KvRequest | None:
    """Parse and check the kv_* fields of one request; ``None`` if it sets no budget.

    The one parser of request options: the front end calls it once per request (see
    :mod:`obcache_vllm.vllm_ext.frontend.admission`). ``raw`` may hold other keys (a
    request's ``extra_args``); only ``kv_*`` ones are read.

    Raises:
        KvOptionsError: an unknown ``kv_*`` key, or a value out of its domain.
    """
    raw = {k: v for k, v in (raw or {}).items() if is_kv_option(k)}
    for key, value in raw.items():
        _check_scalar(key, value)
    unknown = sorted(k for k in raw if k not in WIRE_FIELDS)
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
    compress_at = raw.get("kv_compress_at")
    if compress_at is not None and compress_at != AUTO:
        if isinstance(compress_at, str):
            raise KvOptionsError(
                "kv_compress_at", f'must be an integer >= 1 or "{AUTO}"', compress_at
            )
        compress_at = _int_field(raw, "kv_compress_at", 0, 1)
    request = KvRequest(
        budget=_budget_field(raw["kv_budget"]),
        scorer=_name_field(raw, "kv_scorer", DEFAULT_SCORER, scorers),
        pipeline=_name_field(raw, "kv_pipeline", DEFAULT_PIPELINE, pipelines),
        window=_int_field(raw, "kv_window", DEFAULT_WINDOW, 1),
        recent=_int_field(raw, "kv_recent", DEFAULT_RECENT, 0),
        sinks=_int_field(raw, "kv_sinks", DEFAULT_SINKS, 0),
        decode=_bool_field(raw, "kv_decode", False),
        compress_at=compress_at,
        per_head=_bool_field(raw, "kv_per_head", True),
        prefill_evict=_bool_field(raw, "kv_prefill_evict", False),
        session=_bool_field(raw, "kv_session", False),
        when=_name_field(raw, "kv_when", "always", WHEN),
        policy_min_prompt_tokens=policy_min_prompt_tokens,
    )
    if request.session:
        _check_session(request)
    if request.when == "pressure":
        _check_pressure(request)
    if isinstance(request.budget, int):  # a fraction is checked when it is resolved
        _check_room(request.budget, request.sinks, request.recent)
    return request


def parse_kv_options(
    extra_args: Mapping[str, Any] | None,
    num_prompt_tokens: int,
    max_model_len: int | None = None,
) -> KvOptions | None:
    """:func:`parse_request` then :meth:`KvRequest.resolve`: one request's options, or None.

    For callers that hold the fields and the prompt together (the HF reference, the server
    config's validation, tests); a served request takes the two steps at the front end.
    """
    request = parse_request(extra_args)
    return None if request is None else request.resolve(num_prompt_tokens, max_model_len)


def admitted_options(extra_args: Mapping[str, Any] | None) -> KvOptions | None:
    """The options the front end admitted for a request, decoded (EngineCore and worker).

    ``None`` for a stock request (no kv_* field, no admitted form).

    Raises:
        WireError: kv_* fields without an admitted form (the request bypassed the front end's
            admission), or a form that does not decode. Never served unbudgeted: a fault.
    """
    if not extra_args:
        return None
    if ADMITTED_KEY in extra_args:
        return KvOptions.from_wire(extra_args[ADMITTED_KEY])
    fields = [k for k in extra_args if is_kv_option(k)]
    if fields:
        raise WireError(
            f"{fields[0]} set but no admitted options: the request bypassed obcache-vllm's "
            "admission (the input processor)"
        )
    return None
