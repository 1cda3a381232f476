"""Per-request KV-eviction options: declared once, parsed once at the edge, resolved once, carried
as a wire form.

Every ``kv_*`` option is one row of :data:`OPTIONS` (an :class:`OptionSpec`: its field, parser,
default, server default, wire types, documentation, refusals and example values). Everything
else is derived from that table by :class:`OptionTable`: the request model (:class:`KvRequest`),
the resolved options (:class:`KvOptions`), the wire form, the server's built-in defaults
(``obcache_vllm.config.BUILTIN_DEFAULTS``), the config document, the docs' options table
(``docs/reference/rest.md``, ``scripts/gen_reference.py``) and the fuzzer's plausible values
(``tests/server/test_fuzz.py``). Adding an option is adding a row
(``tests/unit/test_option_table.py`` adds a throwaway one and follows it everywhere), then
``scripts/gen_reference.py``, which also rewrites the ``TYPE_CHECKING`` declarations of
:class:`KvRequest` and :class:`KvOptions` after the table in this module (their fields as a reader
or a type checker sees them; a test checks them against the table's classes).

Three shapes, one direction (the front end makes the first two, every later process decodes
the third; :mod:`obcache_vllm.admission` decides each step)::

    request fields (strings, JSON)  --admission.parse_request-->  KvRequest   what was asked
    KvRequest      --admission.resolve(prompt length, context)-->  KvOptions   what it gets
    KvOptions      --to_wire / from_wire-->  a versioned tuple of primitives in
                   SamplingParams.extra_args["obcache"], decoded by EngineCore and the worker

This module holds what a single field may be (each row's parser); which fields a request may
combine, how they resolve on a prompt and what the engine refuses are admission's. A request
without ``kv_budget`` is a stock vLLM request: the table's parser returns ``None`` and nothing
else in obcache-vllm touches it.

Budget rule (see :mod:`obcache_vllm.eviction.planning`): eviction frees whole KV blocks only,
so the kept count K of a compressed request satisfies ``budget <= K < budget + block_size``.

Every error is a :class:`KvOptionsError` naming the offending field; the front end turns it
into vLLM's ``VLLMValidationError`` (HTTP 400) before anything is allocated for the request.
"Wire" here is always the versioned tuple (:meth:`KvOptions.to_wire`, :data:`WIRE_VERSION`);
the request's field names are "fields" (:data:`FIELDS`).
Plain Python: no vLLM import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

# kv_-prefixed extra_args keys that belong to vLLM, not to us (KV-connector transfer params).
FOREIGN_KV_KEYS = ("kv_transfer_params",)

# The extra_args key of the admitted options' wire tuple: written by the input processor's step
# (admission), read by EngineCore and the worker; it holds nothing else. Reserved, as are the
# front end's own keys (admission.STAGE_KEYS): a client that sends one in vllm_xargs gets a
# 400.
ADMITTED_KEY = "obcache"
WIRE_VERSION = "obcache/1"

WHEN = ("always", "pressure")
# kv_compress_at's one non-integer value: the front end chooses k from the prompts it has seen.
AUTO = "auto"
# A first sighting of a prompt under "auto" (a whole-prompt request, a tentative session)
# compresses all of its prompt but this many last tokens, which are then computed on the
# compressed cache: its first token is a function of the compressed cache, so the same prompt
# sent again (a retry, an agent re-sending its context) adopts that cache and gets the same
# answer (obcache_vllm.eviction.sightings). One token: the query the eviction scores with
# moves by one position.
FIRST_POINT = 1


class KvOptionsError(ValueError):
    """A kv_* request option is invalid. ``field`` is the request field it names (``kv_budget``)."""

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


# -- value parsers: (field, raw value) -> value, or KvOptionsError naming the field ----------
Parser = Callable[[str, Any], Any]


def integer(minimum: int) -> Parser:
    """An integer >= ``minimum`` (an integral float is taken; a boolean is not)."""

    def parse(field: str, value: Any) -> int:
        # bool is an int subclass; "true" as a window is a client bug, not a 1.
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise KvOptionsError(field, f"must be an integer >= {minimum}", value)
        if value < minimum:
            raise KvOptionsError(field, f"must be an integer >= {minimum}", value)
        return value

    return parse


def boolean(field: str, value: Any) -> bool:
    """true/false, "true"/"false" or 1/0 (``vllm_xargs`` turns a JSON true into 1)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if type(value) is int and value in (0, 1):
        return value == 1
    raise KvOptionsError(field, "must be a boolean", value)


def one_of(known: Callable[[], Sequence[str]]) -> Parser:
    """One of the names ``known()`` lists (called per request: registries may grow)."""

    def parse(field: str, value: Any) -> str:
        names = tuple(known())
        if not isinstance(value, str) or value not in names:
            shown = bounded(value)
            shown = repr(value) if shown is value else shown
            raise KvOptionsError(field, f"unknown name {shown}; known: {', '.join(names)}", value)
        return value

    return parse


@dataclass(frozen=True)
class ErrorTarget:
    """A budget given as a quality: keep the fewest tokens whose estimated error is at most
    ``max_error``, never fewer than ``floor`` (tokens, or a fraction like a budget; None: one
    more than the sinks and recent tokens). See :mod:`obcache_vllm.scoring.estimate`.

    ``kl``: the target is in nats of the next-token distributions' KL divergence from the full
    cache's (``{"max_kl": nats}``), predicted from every layer's error by the served model's
    calibration (:mod:`obcache_vllm.scoring.calibration`); else in the estimate's own unit
    (``{"max_error": e}``)."""

    max_error: float
    floor: int | float | None = None
    kl: bool = False

    @property
    def key(self) -> str:
        return KL_KEY if self.kl else ERROR_KEY

    def scalar(self) -> str:
        """The scalar form (``vllm_xargs``, environment variables, the wire tuple)."""
        floor = "" if self.floor is None else f",min:{self.floor!r}"
        return f"{self.key}:{self.max_error!r}{floor}"


ERROR_KEY = "max_error"
KL_KEY = "max_kl"
_TARGET_KEYS = (ERROR_KEY, KL_KEY, "min")
_TARGET_SHAPE = (
    'an integer >= 1, a fraction in (0, 1], or a target {"max_error": e} or {"max_kl": nats} '
    '(optionally with "min": a floor budget; scalar form "max_error:e[,min:m]")'
)


def is_error_target(value: Any) -> bool:
    """Whether a raw ``kv_budget`` value asks for a quality (before it is parsed)."""
    if isinstance(value, Mapping):
        return True
    return isinstance(value, str) and value.strip().startswith((ERROR_KEY, KL_KEY))


def _target_items(field: str, value: Any) -> dict[str, Any]:
    """The ``{"max_error": .., "min": ..}`` items of a mapping or of its scalar form."""
    if isinstance(value, Mapping):
        items = dict(value)
    else:
        items = {}
        for part in value.split(","):
            key, sep, raw = part.partition(":")
            if not sep:
                raise KvOptionsError(field, f"must be {_TARGET_SHAPE}", value)
            try:
                number = float(raw)
            except ValueError:
                raise KvOptionsError(field, f"{key.strip()}: not a number", value) from None
            items[key.strip()] = int(number) if key.strip() == "min" and "." not in raw else number
    unknown = sorted(str(k) for k in items if k not in _TARGET_KEYS)
    targets = [k for k in (ERROR_KEY, KL_KEY) if k in items]
    if unknown or len(targets) != 1:
        why = (f"unknown key {unknown[0]!r}" if unknown else
               f"{ERROR_KEY} and {KL_KEY} together" if targets else
               f"{ERROR_KEY} (or {KL_KEY}) is missing")  # fmt: skip
        raise KvOptionsError(field, f"{why}; must be {_TARGET_SHAPE}", value)
    return items


def error_target(field: str, value: Any) -> ErrorTarget:
    """``{"max_error": e, "min": m}`` or ``"max_error:e,min:m"``: e a number > 0 (the
    estimate's unit: :mod:`obcache_vllm.scoring.estimate`), m a budget (the floor);
    ``{"max_kl": nats, "min": m}`` (``"max_kl:nats,min:m"``): the target in nats."""
    items = _target_items(field, value)
    key = KL_KEY if KL_KEY in items else ERROR_KEY
    target = items[key]
    if isinstance(target, bool) or not isinstance(target, (int, float)):
        raise KvOptionsError(field, f"{key} must be a number > 0", value)
    if not math.isfinite(target) or target <= 0:
        raise KvOptionsError(field, f"{key} must be a finite number > 0", value)
    floor = items.get("min")
    if floor is not None:
        try:
            floor = budget(field, floor)
        except KvOptionsError as exc:
            raise KvOptionsError(field, f"min {str(exc).split(': ', 1)[1]}", value) from None
        if isinstance(floor, ErrorTarget):
            raise KvOptionsError(field, "min must be a budget, not an error target", value)
    return ErrorTarget(float(target), floor, kl=key == KL_KEY)


def budget(field: str, value: Any) -> int | float | ErrorTarget:
    """An integer >= 1 (tokens), a fraction in (0, 1] (of the prompt or the compress point),
    or an error target (:func:`error_target`)."""
    if is_error_target(value):
        return error_target(field, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KvOptionsError(field, f"must be {_TARGET_SHAPE}", value)
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


def point(field: str, value: Any) -> int | str:
    """A prompt position >= 1, a negative ``-n`` (n tokens before the prompt's end, resolved
    against each prompt), or ``"auto"``."""
    if value == AUTO:
        return AUTO
    why = f'must be an integer >= 1, a negative integer (tokens before the end) or "{AUTO}"'
    if isinstance(value, str) or value == 0:
        raise KvOptionsError(field, why, value)
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return value
    try:
        return integer(1)(field, value)
    except KvOptionsError:
        raise KvOptionsError(field, why, value) from None


def _scorer_names() -> tuple[str, ...]:
    from obcache_vllm.scoring import SCORER_NAMES

    return tuple(SCORER_NAMES)


def _pipeline_names() -> tuple[str, ...]:
    from obcache_vllm.scoring import pipeline_names

    return pipeline_names()


# -- the table ----------------------------------------------------------------------------------
_SAME = object()  # OptionSpec.server_default: the same as the option's own default


@dataclass(frozen=True)
class OptionSpec:
    """One kv_* request option, declared once (see the module docstring).

    ``field``: the request field (``kv_window``); its attribute on :class:`KvRequest` and
    :class:`KvOptions` is the name without ``kv_``. ``parse``: the value parser (given the field
    and a value that is present and not null). ``default``: what an unset field means (the
    offline engine's default; :data:`REQUIRED` for the budget). ``server_default``: the server's
    built-in default (``None``: no server-wide default, the option depends on the request's own
    prompt). ``types``: the Python types of the resolved value (the wire form's check).
    ``doc``: the documentation's paragraph (Markdown). Combinations of options a request cannot
    have are admission's (:func:`obcache_vllm.admission.refuse_options`), not a row's.
    ``examples``: values valid on their own (the fuzzer's plausible requests; combinations are
    the refusals' business; none for a prompt position).
    """

    field: str
    parse: Parser
    default: Any
    types: tuple[type, ...]
    doc: str
    server_default: Any = _SAME
    examples: tuple[Any, ...] | Callable[[], Sequence[Any]] = ()

    @property
    def name(self) -> str:
        return self.field.removeprefix("kv_")

    @property
    def builtin_server_default(self) -> Any:
        return self.default if self.server_default is _SAME else self.server_default

    @property
    def per_request_only(self) -> bool:
        """No server-wide default: the option depends on the request's own prompt."""
        return self.server_default is None and self.default is not REQUIRED

    def example_values(self) -> tuple[Any, ...]:
        """:attr:`examples` (a registry's names are listed when asked: registries grow)."""
        return tuple(self.examples() if callable(self.examples) else self.examples)

    def value(self, raw: Mapping[str, Any]) -> Any:
        """The parsed value of this option in ``raw``: its default when unset; ``null`` only
        where the default is itself ``None`` (else it is refused as the parser refuses it)."""
        if self.field not in raw:
            return self.default
        value = raw[self.field]
        if value is None and self.default is None:
            return None
        return self.parse(self.field, value)


REQUIRED = dataclasses.MISSING  # OptionSpec.default of an option every budgeted request sets

OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec(
        "kv_budget", budget, REQUIRED, (int,), server_default=None,
        doc="int >= 1: KV tokens kept per layer and KV head after eviction; float in (0, 1]: "
        "that fraction of the prompt (rounded up; of k with `kv_compress_at`). "
        '`{"max_error": e}` (or `"max_error:e"` where only scalars travel): an error target, '
        "the fewest tokens whose estimated error is at most e, never fewer than its optional "
        '`"min"` (a budget as above; default `kv_sinks + kv_recent + 1`); `{"max_kl": nats}`: '
        "the same in nats of KL from the full cache's next-token distributions, for a model "
        'that ships a calibration; see "Budgets by error target". Unset: a stock request',
        examples=(64, 96, 200, {"max_error": 0.05}, {"max_kl": 0.2}),
    ),
    OptionSpec(
        "kv_scorer", one_of(_scorer_names), "obcache_key", (str,),
        examples=_scorer_names,
        doc="token score: `obcache_key`, `obcache_value`, `obcache_joint` (OBCache), `attn`, "
        "`value_norm`, `dropkv` (the squared output change of evicting the token alone, "
        "DropKV's), `key_norm`, `random` (`obcache_vllm.scoring.SCORER_NAMES`)",
    ),
    OptionSpec(
        "kv_pipeline", one_of(_pipeline_names), "snapkv", (str,),
        examples=_pipeline_names,
        doc="selection pipeline: `snapkv` (last `kv_window` queries, max-pooled), `h2o` (all "
        "prompt queries), `tova` (last query), `streaming` (sinks + recent), `adakv` "
        "(snapkv's scores, the layer's total spread over its KV heads by AdaKV's rule, each "
        "head in memory of its own: the request's blocks follow the sum of its heads' kept "
        "tokens). `adakv` evicts at the compress point and, with `kv_decode`, again as "
        "decoding fills its budget (every head re-selected over its own entries), and a "
        "session continues its per-head cache; on the CPU backend without tensor "
        "parallelism; not with `kv_prefill_evict`, "
        '`kv_when: "pressure"` or an error target; `kv_per_head` has no effect on it (each '
        "head ranks its own entries by definition), and at a compress point it neither "
        "adopts nor leaves compressed entries",
    ),
    OptionSpec(
        "kv_window", integer(1), 64, (int,), examples=(1, 8, 32),
        doc="snapkv's observation window (last prompt queries), at most the model context",
    ),
    OptionSpec(
        "kv_recent", integer(0), 16, (int,), examples=(0, 4),
        doc="most recent tokens always kept",
    ),
    OptionSpec(
        "kv_sinks", integer(0), 4, (int,), examples=(0, 2),
        doc="first tokens always kept (attention sinks)",
    ),
    OptionSpec(
        "kv_decode", boolean, False, (bool,), examples=(False, True, "true", 1),
        doc="also evict while generating (running scores, one block at a time; an error "
        "target keeps the count it chose at the prompt's end). Booleans are "
        '`true`/`false`, `"true"`/`"false"` or `1`/`0` (in `vllm_xargs` vLLM turns JSON '
        "booleans into integers)",
    ),
    OptionSpec(
        "kv_compress_at", point, None, (int, type(None)), server_default=None,
        doc="int k, 1 <= k <= prompt length: evict once the first k prompt tokens are cached, "
        "scored with queries from those k only; the rest of the prompt (e.g. the question) is "
        'then prefilled on the compressed cache ("query-agnostic"). A negative -n is k = '
        "prompt length - n, for clients that send one setting for prompts of any length (an "
        "evaluation harness's question of up to n tokens at the end). "
        '`"auto"`: a prompt that '
        'continues a recent `"auto"` prompt (a chat\'s next turn) is served as `kv_session`; '
        "a prompt seen before, all of it, is compressed where it was then (and adopts that "
        "cache: the same answer); else k is the longest prefix (whole blocks, at least half "
        "the prompt) it shares with a recent one, else all but its last token, as a tentative "
        "`kv_session` (its final cache is kept for a next turn while the pool has room, and "
        "its compressed prompt for a repeat of it); the server policy's default budget "
        'uses it. With `h2o` or `adakv`, `"auto"` is the whole prompt and starts no session '
        "(neither leaves an entry at a compress point; adakv takes sessions when asked, with "
        "`kv_session` or `session_id`). On an engine that serves no session (speculative "
        "decoding, Gemma 2/3's sliding-window layers, prefix caching off) it starts none: it "
        "compresses at the shared prefix it chose, else the whole prompt. Unset: the whole "
        "prompt",
    ),
    OptionSpec(
        "kv_per_head", boolean, True, (bool,), examples=(True, False),
        doc="true: each KV head keeps its own top tokens; false: one ranking per layer (scores "
        "summed over its KV heads, as kvpress's presses select)",
    ),
    OptionSpec(
        "kv_prefill_evict", boolean, False, (bool,), examples=(False, True),
        doc="true: also evict after every prefill chunk that leaves a whole block over budget, "
        "so the prompt never holds more than `ceil((budget + chunk) / block size) + 1` blocks "
        "while it is prefilled and a prompt longer than the KV pool can be served. Each "
        "chunk's eviction is scored with the queries prefilled so far (as `kv_compress_at` at "
        "that chunk's end)",
    ),
    OptionSpec(
        "kv_session", boolean, False, (bool,), server_default=None,
        examples=(False, True),
        doc="true: continue from the compressed cache an earlier `kv_session` request left "
        "behind, if its tokens (prompt and output, as cached) are exactly a prefix of this "
        "prompt and its options and cache salt are the same; leave this request's final cache "
        "for the next turn. vLLM's `session_id` (body, `X-Session-ID`, `vllm_xargs`) does the "
        "same. Not with `h2o` (its running sums would have to travel with the cache), "
        "`kv_compress_at` or `kv_prefill_evict`",
    ),
    OptionSpec(
        "kv_when", one_of(lambda: WHEN), "always", (str,),
        examples=WHEN,
        doc="`\"always\"`: evict as the options say; `\"pressure\"`: run exactly as stock vLLM "
        "while the KV pool has room, and compress to the budget only when the scheduler would "
        "otherwise preempt a running request or leave a waiting one unadmitted for lack of "
        "blocks. Not with `h2o`, `kv_compress_at`, `kv_prefill_evict` or `kv_session`",
    ),
)  # fmt: skip


# -- what is derived from the table -------------------------------------------------------------
def _resolved_only() -> list[tuple]:
    """Fields of :class:`KvOptions` that no request sets: made by :meth:`KvRequest.resolve`."""
    return [
        # What the client asked for: an int, or the fraction (``budget`` is the resolved tokens).
        ("requested_budget", Any, field(default=None, compare=False, kw_only=True)),
        # A session the front end started on its own (``kv_compress_at: "auto"`` on a prompt
        # that continues nothing): its entry is held only while no request needs the blocks.
        ("tentative", bool, field(default=False, kw_only=True)),
        # An error target (kv_budget {"max_error": e}): ``budget`` is then its floor, and the
        # worker keeps the fewest tokens, at or above it, whose estimated error is at most e.
        ("max_error", Any, field(default=None, kw_only=True)),
        # ... and in nats ({"max_kl": nats}): ``max_error`` is then that many nats, and the
        # worker predicts each count's KL from its layers' errors (scoring.calibration).
        ("kl_target", bool, field(default=False, kw_only=True)),
    ]


_RESOLVED_TYPES: dict[str, tuple[type, ...]] = {
    "requested_budget": (int, float, str, type(None)),
    "tentative": (bool,),
    "max_error": (float, type(None)),
    "kl_target": (bool,),
}


class _OptionsMethods:
    """The methods of :class:`KvOptions` (its fields come from the table)."""

    __slots__ = ()
    table: OptionTable

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
    def heads_own_memory(self) -> bool:
        """Whether its pipeline lays each KV head out in memory of its own (adakv)."""
        return self._pipeline.heads_own_memory

    @property
    def query_window(self) -> int:
        """How many of the last prompt queries the prefill score needs (0: none, -1: all),
        as the pipeline declares (its ``window``; None: every query)."""
        window = self._pipeline.window
        return -1 if window is None else window

    # -- the wire form: a versioned tuple of primitives (msgspec and pickle carry it) ------
    def to_wire(self) -> tuple:
        return (WIRE_VERSION, *(getattr(self, name) for name in self.table.wire_names))

    @classmethod
    def from_wire(cls, value: Any):
        """Decode :meth:`to_wire`'s tuple (a list after msgspec); raises :class:`WireError`.

        Checks shape and primitive types only: the values were validated at admission.
        """
        names = cls.table.wire_names
        if not isinstance(value, (tuple, list)) or not value or value[0] != WIRE_VERSION:
            raise WireError(f"not an {WIRE_VERSION} wire form: {bounded(value)!r}")
        if len(value) != len(names) + 1:
            raise WireError(f"{WIRE_VERSION} wire form of {len(value)} items: {bounded(value)!r}")
        values = dict(zip(names, value[1:], strict=True))
        for name, kinds in cls.table.wire_types.items():
            item = values[name]
            if not isinstance(item, kinds) or (isinstance(item, bool) and bool not in kinds):
                raise WireError(f"{WIRE_VERSION} wire field {name}={bounded(item)!r}")
        return cls(**values)


class _RequestMethods:
    """The methods of :class:`KvRequest` (its fields come from the table)."""

    __slots__ = ()
    table: OptionTable

    def options(self, **resolved: Any):
        """The :class:`KvOptions` of this request's fields, with ``resolved`` over them (what
        :func:`obcache_vllm.admission.resolve` decided on a prompt: the budget in tokens, the
        compress point, ``requested_budget``, ``max_error``, ``kl_target``, ``tentative``)."""
        values = {spec.name: getattr(self, spec.name) for spec in self.table.specs}
        return self.table.options_type(**{**values, **resolved})


class OptionTable:
    """Everything derived from a table of :class:`OptionSpec` rows: the request model and the
    resolved options (frozen dataclasses, one field per row, in the table's order), the wire
    form's names and types, the parser and the built-in server defaults.

    The module's own table is :data:`TABLE`; a test builds another with a throwaway row.
    """

    def __init__(self, specs: Sequence[OptionSpec], module: str = __name__) -> None:
        self.specs = tuple(specs)
        self.fields = tuple(spec.field for spec in self.specs)
        if len(set(self.fields)) != len(self.fields) or not all(map(is_kv_option, self.fields)):
            raise ValueError(f"option fields must be distinct kv_* names: {self.fields}")

        def declared(spec: OptionSpec, types: tuple[type, ...]) -> tuple:
            kind = types[0] if len(types) == 1 else Any
            if spec.default is REQUIRED:
                return (spec.name, kind)
            return (spec.name, kind, field(default=spec.default))

        def make(name: str, fields_: list, methods: type, doc: str) -> type:
            cls = dataclasses.make_dataclass(
                name, fields_, bases=(methods,), frozen=True,
                namespace={"table": self, "__module__": module},
            )  # fmt: skip
            cls.__doc__ = doc
            return cls

        self.request_type = make(
            "KvRequest", [declared(s, (Any,)) for s in self.specs],
            _RequestMethods,
            "What one request asked for: every kv_* field parsed and checked, the prompt not "
            "yet known (one field per :data:`OPTIONS` row). :meth:`resolve` applies it to a "
            "prompt and returns the :class:`KvOptions` it gets.",
        )
        self.options_type = make(
            "KvOptions", [*(declared(s, s.types) for s in self.specs), *_resolved_only()],
            _OptionsMethods,
            "The resolved eviction options of one request (frozen; what EngineCore and the "
            "worker see). ``budget`` is the resolved token budget (a ratio is already applied "
            "to the prompt length); ``requested_budget`` is what the client asked for.",
        )
        self.wire_names = tuple(f.name for f in fields(self.options_type))
        types = {spec.name: spec.types for spec in self.specs}
        self.wire_types = {name: {**types, **_RESOLVED_TYPES}[name] for name in self.wire_names}

    def spec(self, field_name: str) -> OptionSpec:
        return self.specs[self.fields.index(field_name)]

    def builtin_defaults(self) -> dict[str, Any]:
        """The server's built-in defaults: every field (``None``: no default)."""
        return {spec.field: spec.builtin_server_default for spec in self.specs}

    def per_request_only(self) -> tuple[str, ...]:
        return tuple(spec.field for spec in self.specs if spec.per_request_only)

    def parse_request(self, raw: Mapping[str, Any] | None):
        """Every kv_* field of ``raw`` parsed in its own domain (a request's ``extra_args``:
        other keys are ignored); ``None`` if it sets no budget. Combinations of fields are
        admission's (:func:`obcache_vllm.admission.parse_request`, which calls this).

        Raises:
            KvOptionsError: an unknown ``kv_*`` key, or a value out of its domain.
        """
        raw = {k: v for k, v in (raw or {}).items() if is_kv_option(k)}
        for key, value in raw.items():
            _check_scalar(key, value)
        unknown = sorted(k for k in raw if k not in self.fields)
        if unknown:
            raise KvOptionsError(
                unknown[0], f"unknown option; known: {', '.join(self.fields)}", raw[unknown[0]]
            )
        if raw.get("kv_budget") is None:
            others = [k for k in self.fields if k in raw and raw[k] is not None]
            if others:
                raise KvOptionsError(others[0], "requires kv_budget", raw[others[0]])
            return None
        values = {spec.name: spec.value(raw) for spec in self.specs}
        return self.request_type(**values)


def _check_scalar(key: str, value: Any) -> None:
    """A JSON scalar, an int within int64, a finite float (vLLM's transport carries int64);
    ``kv_budget`` may also be an error target's object."""
    if key == "kv_budget" and isinstance(value, Mapping):
        return
    if value is not None and not isinstance(value, (str, int, float, bool)):
        raise KvOptionsError(key, f"must be a scalar, got {type(value).__name__}", value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        raise KvOptionsError(key, "out of range", value)
    if isinstance(value, float) and not math.isfinite(value):
        raise KvOptionsError(key, "must be finite", value)


TABLE = OptionTable(OPTIONS)
# KvRequest and KvOptions, as a reader or a type checker sees them; at run time the table's
# classes (tests/unit/test_option_table.py checks that both have these fields).
# -- generated by scripts/gen_reference.py from OPTIONS: do not edit ---------------------------
if TYPE_CHECKING:

    @dataclass(frozen=True)
    class KvRequest(_RequestMethods):
        """What one request asked for, every kv_* field parsed (see :meth:`resolve`)."""

        budget: Any
        scorer: Any = "obcache_key"
        pipeline: Any = "snapkv"
        window: Any = 64
        recent: Any = 16
        sinks: Any = 4
        decode: Any = False
        compress_at: Any = None
        per_head: Any = True
        prefill_evict: Any = False
        session: Any = False
        when: Any = "always"

    @dataclass(frozen=True)
    class KvOptions(_OptionsMethods):
        """The resolved options of one request (what EngineCore and the worker see)."""

        budget: int
        scorer: str = "obcache_key"
        pipeline: str = "snapkv"
        window: int = 64
        recent: int = 16
        sinks: int = 4
        decode: bool = False
        compress_at: int | None = None
        per_head: bool = True
        prefill_evict: bool = False
        session: bool = False
        when: str = "always"
        requested_budget: int | float | str | None = field(
            default=None, compare=False, kw_only=True
        )
        tentative: bool = field(default=False, kw_only=True)
        max_error: float | None = field(default=None, kw_only=True)
        kl_target: bool = field(default=False, kw_only=True)

else:
    KvRequest = TABLE.request_type
    KvOptions = TABLE.options_type
# -- end of the generated block ----------------------------------------------------------------
FIELDS = TABLE.fields


def default(field_name: str) -> Any:
    """The option's own default (what an unset field means)."""
    return TABLE.spec(field_name).default


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
    fields_set = [k for k in extra_args if is_kv_option(k)]
    if fields_set:
        raise WireError(
            f"{fields_set[0]} set but no admitted options: the request bypassed obcache-vllm's "
            "admission (the input processor)"
        )
    return None
