"""Server-wide defaults of the kv_* request options: a YAML file plus environment variables.

Sources, later wins:

1. the built-in defaults (:data:`BUILTIN_DEFAULTS`, from :data:`obcache_vllm.options.OPTIONS`);
2. the YAML file ``$OBCACHE_VLLM_CONFIG`` if set, else the package's own
   ``obcache_vllm/default.yaml`` (shipped in the wheel; ``configs/default.yaml`` of a checkout
   is a link to it), so ``pip install`` and a checkout serve the same defaults;
3. one environment variable per option: ``OBCACHE_KV_BUDGET``, ``OBCACHE_KV_SCORER``, ...
   (values are parsed as YAML scalars: ``0.25`` is a float, ``true`` a boolean, ``null`` none).

Validated once, at server start (:func:`load_policy` raises :class:`ConfigError` naming the
source and the key). A request field always overrides its default
(:func:`obcache_vllm.admission.merge_fields`).

The operator's policy: a default ``kv_budget`` (with ``kv_when: pressure``, compression only
when the pool is short) applies to every request that sets no budget, or, with
``min_prompt_tokens`` (YAML key, or ``OBCACHE_MIN_PROMPT_TOKENS``), only to prompts of at least
that many tokens. A request opts out with ``"kv_budget": null``. Where a budget from the policy
cannot be served (a refused configuration or request) the request is served as stock vLLM
instead of refused: the client did not ask for it.

Where the policy's budget applies, it compresses at ``compress_at`` (YAML key, or
``OBCACHE_POLICY_COMPRESS_AT``): ``auto`` (the default) is ``kv_compress_at: "auto"``, the
longest prefix the prompt shares with recent prompts (see
:mod:`obcache_vllm.eviction.sightings`), so a shared document is compressed once and reused
as stock vLLM reuses it from its prefix cache, and a chat's next turn (a prompt that extends a
recent one) continues as a ``kv_session``; ``null`` compresses every prompt whole. It
applies only where the request's options allow a compress point (not with ``kv_session``,
``kv_when: pressure`` or ``kv_prefill_evict``) and the client set no ``kv_compress_at``.

A model may have its own selection (``models:`` in the YAML file, a mapping of a model's name,
its directory's or hub id's last part, to selection fields; written by
``scripts/choose_defaults.py`` from a rule run on that model): a server serving that model
takes those fields in place of the file's (:func:`load_policy`, ``model``), unless the operator
set a selection field by variable or flag, which every model then gets.
Plain Python: no vLLM import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from obcache_vllm import admission, options, settings
from obcache_vllm.admission import COMPRESS_AT_KEY, MIN_PROMPT_KEY, QUERY_AGNOSTIC_KEY, Policy

CONFIG_ENV = settings.CONFIG
ENV_PREFIX = settings.KV_PREFIX
MIN_PROMPT_ENV = settings.MIN_PROMPT_TOKENS
COMPRESS_AT_ENV = settings.POLICY_COMPRESS_AT
QUERY_AGNOSTIC_ENV = settings.POLICY_QUERY_AGNOSTIC
# The policy's own keys (beside the kv_* defaults): YAML key -> (environment variable, default).
POLICY_KEYS: dict[str, tuple[str, Any]] = {
    MIN_PROMPT_KEY: (MIN_PROMPT_ENV, 0),
    COMPRESS_AT_KEY: (COMPRESS_AT_ENV, options.AUTO),
    QUERY_AGNOSTIC_KEY: (QUERY_AGNOSTIC_ENV, None),
}
PACKAGED_CONFIG = Path(__file__).resolve().parent / "default.yaml"

# Every request field's built-in server default (None: no default), from the options' table.
BUILTIN_DEFAULTS: dict[str, Any] = options.TABLE.builtin_defaults()
# Options that depend on the request's own prompt: no server-wide default.
PER_REQUEST_ONLY = options.TABLE.per_request_only()
MODELS_KEY = "models"  # per-model selections (YAML only)


class ConfigError(ValueError):
    """The server-wide kv_* defaults are invalid; the message names the source and key."""


def env_name(field: str) -> str:
    """``kv_budget`` -> ``OBCACHE_KV_BUDGET``."""
    return settings.kv_name(field)


def config_path(environ: Mapping[str, str]) -> Path | None:
    """The YAML file in effect, or None (built-in defaults only)."""
    explicit = settings.value(CONFIG_ENV, environ)
    if explicit:
        return Path(explicit)
    return PACKAGED_CONFIG if PACKAGED_CONFIG.is_file() else None


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{CONFIG_ENV}: cannot read {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of kv_* options, got {type(data).__name__}")
    return data


def validate_defaults(defaults: Mapping[str, Any], source: str) -> None:
    """Raise :class:`ConfigError` unless ``defaults`` are valid kv_* defaults.

    The same parser as requests' (:func:`obcache_vllm.admission.parse_kv_options`: each
    value in its domain, and the combinations admission refuses). Without a
    default budget the other options are checked against a stand-in budget; a fractional budget
    is checked against a long prompt (its value for short prompts is checked per request).
    """
    unknown = sorted(set(defaults) - set(options.FIELDS) - set(POLICY_KEYS) - {MODELS_KEY})
    if unknown:
        known = ", ".join((*options.FIELDS, *POLICY_KEYS, MODELS_KEY))
        raise ConfigError(f"{source}: unknown key {unknown[0]!r}; known: {known}")
    fixed = [k for k in PER_REQUEST_ONLY if defaults.get(k) is not None]
    if fixed:
        raise ConfigError(
            f"{source}: {fixed[0]} is a per-request option (it depends on the request's prompt)"
        )
    threshold = defaults.get(MIN_PROMPT_KEY, 0)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ConfigError(f"{source}: {MIN_PROMPT_KEY} must be an integer >= 0, got {threshold!r}")
    point = defaults.get(COMPRESS_AT_KEY, options.AUTO)
    if point not in (options.AUTO, None):
        raise ConfigError(
            f"{source}: {COMPRESS_AT_KEY} must be {options.AUTO!r} or null, got {point!r}"
        )
    probe = {k: v for k, v in defaults.items()
             if v is not None and k not in POLICY_KEYS and k != MODELS_KEY}  # fmt: skip
    probe.setdefault("kv_budget", 1 << 20)
    try:
        admission.parse_kv_options(probe, num_prompt_tokens=1 << 20)
    except options.KvOptionsError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    _validate_query_agnostic(defaults.get(QUERY_AGNOSTIC_KEY), probe, source)
    _validate_models(defaults.get(MODELS_KEY), probe, source)


def _validate_models(models: Any, probe: dict[str, Any], source: str) -> None:
    """``models``: null, or a mapping of model names to selections, each a mapping of
    selection fields whose values are valid over the other defaults (as the file's own)."""
    if models is None:
        return
    if not isinstance(models, dict):
        raise ConfigError(f"{source}: {MODELS_KEY} must be a mapping of model names to "
                          f"selections, or null; got {models!r}")  # fmt: skip
    for name, selection in models.items():
        where = f"{source}: {MODELS_KEY}: {name!r}"
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"{where}: a model's name is its directory's (or hub id's) last "
                              "part, e.g. gemma-3-270m")  # fmt: skip
        _check_selection_fields(selection, where, "")
        try:
            admission.parse_kv_options({**probe, **selection}, num_prompt_tokens=1 << 20)
        except options.KvOptionsError as exc:
            raise ConfigError(f"{where}: with the other defaults, {exc}") from exc


def _check_selection_fields(selection: Any, where: str, alternatives: str) -> None:
    """A selection is a non-empty mapping of selection fields (``alternatives``: what else
    the key may be, for the message)."""
    if not isinstance(selection, dict) or not selection:
        raise ConfigError(f"{where} must be a mapping of "
                          f"{', '.join(admission.SELECTION_FIELDS)}{alternatives}; "
                          f"got {selection!r}")  # fmt: skip
    unknown = sorted(set(selection) - set(admission.SELECTION_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: {unknown[0]!r} is not a selection field; known: "
                          f"{', '.join(admission.SELECTION_FIELDS)}")  # fmt: skip


def _validate_query_agnostic(selection: Any, probe: dict[str, Any], source: str) -> None:
    """The policy's ``query_agnostic`` selection: null, or a mapping of selection fields whose
    values are valid together, and that, over the other defaults, do not refuse a
    query-agnostic request those defaults alone would serve (a default error target with a
    pipeline that has no scored queries, prefill chunks with adakv, ...)."""
    if selection is None:
        return
    key = QUERY_AGNOSTIC_KEY
    _check_selection_fields(selection, f"{source}: {key}", ", or null")
    point = {"kv_compress_at": 1 << 19}
    # The selection's own values and combinations, with a stand-in budget and without the
    # options that refuse any compress point whatever the selection (pressure, sessions).
    alone = {k: v for k, v in probe.items()
             if k not in ("kv_budget", "kv_when", "kv_prefill_evict", "kv_session")}  # fmt: skip
    try:
        admission.parse_kv_options({**alone, **selection, "kv_budget": 1 << 20, **point},
                                   num_prompt_tokens=1 << 20)  # fmt: skip
    except options.KvOptionsError as exc:
        raise ConfigError(f"{source}: {key}: {exc}") from exc
    # Over every other default, the budget included: a refusal the defaults' own selection
    # does not meet is the selection's.
    try:
        admission.parse_kv_options({**probe, **point}, num_prompt_tokens=1 << 20)
    except options.KvOptionsError:
        return  # such requests are refused whatever the selection
    try:
        admission.parse_kv_options({**probe, **selection, **point}, num_prompt_tokens=1 << 20)
    except options.KvOptionsError as exc:
        raise ConfigError(f"{source}: {key}: with the other defaults, {exc}") from exc


def load_policy(environ: Mapping[str, str] | None = None, model: str | None = None) -> Policy:
    """The validated policy (:class:`obcache_vllm.admission.Policy`): defaults of every
    request field (``None``: no default), its keys.

    ``model``: the served model (a path or hub id). Where the file's ``models`` names it (its
    last part, :func:`model_name`), that selection replaces the file's, unless the operator
    set a selection field by variable or flag (a choice for this server, whatever its model).
    The query-agnostic selection stays the file's: no model has its own evidence for it."""
    environ = os.environ if environ is None else environ
    defaults = load_defaults(environ, keep_policy=True)
    threshold = defaults.pop(MIN_PROMPT_KEY, 0)
    point = defaults.pop(COMPRESS_AT_KEY, options.AUTO)
    agnostic = defaults.pop(QUERY_AGNOSTIC_KEY, None)
    selection = (defaults.pop(MODELS_KEY, None) or {}).get(model_name(model) if model else None)
    operator = set(settings.kv_defaults(options.FIELDS, environ)) & set(admission.SELECTION_FIELDS)
    if selection and not operator:
        defaults.update(selection)
    return Policy(defaults, threshold, point, agnostic)


def model_name(model: str) -> str:
    """A served model's name in ``models``: its directory's (or hub id's) last part, as the
    KL calibrations name it (:func:`obcache_vllm.scoring.calibration.model_key`)."""
    return Path(str(model).rstrip("/")).name


def load_defaults(environ: Mapping[str, str] | None = None, keep_policy: bool = False) -> dict:
    """The validated server-wide defaults (every request field; ``None`` = no default)."""
    import yaml

    environ = os.environ if environ is None else environ
    defaults: dict[str, Any] = {**BUILTIN_DEFAULTS, **{k: v for k, (_, v) in POLICY_KEYS.items()},
                                MODELS_KEY: None}
    path = config_path(environ)
    if path is not None:
        from_file = _read_yaml(path)
        validate_defaults(from_file, str(path))
        defaults.update(from_file)
    from_env: dict[str, Any] = {}
    for field, raw in settings.kv_defaults(options.FIELDS, environ).items():
        try:
            from_env[field] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{env_name(field)}: cannot parse {raw!r}: {exc}") from exc
    for key, (env, empty) in POLICY_KEYS.items():
        raw = settings.value(env, environ)
        if raw is None:
            continue
        try:
            from_env[key] = yaml.safe_load(raw) if raw.strip() else empty
        except yaml.YAMLError as exc:
            raise ConfigError(f"{env}: cannot parse {raw!r}: {exc}") from exc
    for field, value in from_env.items():
        source = POLICY_KEYS[field][0] if field in POLICY_KEYS else env_name(field)
        validate_defaults({field: value}, source)
    if set(from_env) & set(admission.SELECTION_FIELDS) and QUERY_AGNOSTIC_KEY not in from_env:
        # The operator chose the selection by variable or flag: it is every request's unless
        # they also set the query-agnostic one (the file's was chosen beside the file's).
        defaults[QUERY_AGNOSTIC_KEY] = None
    defaults.update(from_env)
    validate_defaults(defaults, "kv_* defaults (file + environment)")
    if not keep_policy:
        for key in (*POLICY_KEYS, MODELS_KEY):
            defaults.pop(key)
    return defaults


ENTRY_SHARE_ENV = settings.ENTRY_POOL_SHARE
DEFAULT_ENTRY_SHARE = 0.25
ENTRY_SHARE_MAX_ENV = settings.ENTRY_POOL_SHARE_MAX
# Measured (docs/evidence/sessions.md, prefix_caching.md): with least-recently-used victims,
# 0.75 took shared documents from 1.71x to 1.98x stock but round-robin chats from 41 to 38
# continued follow-ups of 44 (the least recently used entry is the next chat's); with victims
# ranked by predicted reuse (OBCACHE_ENTRY_VICTIMS=reuse) chats gain from the room too.
DEFAULT_ENTRY_SHARE_MAX = 0.75


def _share(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = settings.value(name, environ)
    if raw is None or raw == "":
        return default
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"{name}={raw!r}: must be a number from 0 to 1")
    return share


def entry_pool_share(environ: Mapping[str, str] | None = None) -> float:
    """The share of the KV pool that compressed contexts keep out of vLLM's LRU even against
    waiting requests (``$OBCACHE_ENTRY_POOL_SHARE``, 0 to 1; default 0.25; 0: entries are
    ordinary free cached blocks). See :class:`obcache_vllm.eviction.entries.HeldEntries`.

    Raises:
        ConfigError: not a number in [0, 1] (the message names the variable).
    """
    environ = os.environ if environ is None else environ
    return _share(environ, ENTRY_SHARE_ENV, DEFAULT_ENTRY_SHARE)


def entry_pool_share_max(environ: Mapping[str, str] | None = None) -> float:
    """The share of the KV pool that compressed contexts may hold while no request waits for
    it (``$OBCACHE_ENTRY_POOL_SHARE_MAX``; default 0.75, never below :func:`entry_pool_share`):
    holds above the base share give way to a waiting request.

    Raises:
        ConfigError: not a number in [0, 1] (the message names the variable).
    """
    environ = os.environ if environ is None else environ
    base = entry_pool_share(environ)
    if base == 0.0:
        return 0.0  # holding is off
    return max(base, _share(environ, ENTRY_SHARE_MAX_ENV, DEFAULT_ENTRY_SHARE_MAX))


ENTRY_VICTIMS_ENV = settings.ENTRY_VICTIMS


def entry_victims(environ: Mapping[str, str] | None = None) -> str:
    """Which held compressed entry gives way first (``$OBCACHE_ENTRY_VICTIMS``): ``reuse``
    (default: the one whose next read is predicted furthest away) or ``lru`` (the least
    recently used). See :class:`obcache_vllm.eviction.entries.HeldEntries`.

    Raises:
        ConfigError: another value (the message names the variable).
    """
    from obcache_vllm.eviction.entries import VICTIM_ORDERS

    environ = os.environ if environ is None else environ
    raw = settings.value(ENTRY_VICTIMS_ENV, environ) or VICTIM_ORDERS[0]
    if raw not in VICTIM_ORDERS:
        raise ConfigError(f"{ENTRY_VICTIMS_ENV}={raw!r}: must be one of {', '.join(VICTIM_ORDERS)}")
    return raw
