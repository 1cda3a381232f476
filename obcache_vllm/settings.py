"""Every ``OBCACHE_*`` environment variable the package reads: its name, and the one place it
is read (the test and benchmark scripts' own, ``OBCACHE_TEST_CORES``,
``OBCACHE_SUITE_LIMIT_MINUTES``, ``OBCACHE_STRESS_*``, are theirs).

Other modules import the names from here and read through the functions below, each taking
an optional ``environ`` mapping (tests, and the server command, which builds the served
process's environment before starting it) and defaulting to this process's. What a value
means and how it is validated stays with the module that uses it (the server policy's
variables in :mod:`obcache_vllm.config`). Plain Python: every process imports it, the plugin's
entry point and vLLM's workers included.

==============================  ============================================================
variable                        read by
==============================  ============================================================
``OBCACHE_VLLM_CONFIG``         the server policy's YAML file (:mod:`obcache_vllm.config`)
``OBCACHE_KV_<FIELD>``          a server default of one kv_* field (``OBCACHE_KV_BUDGET``)
``OBCACHE_MIN_PROMPT_TOKENS``   the policy's smallest prompt for its default budget
``OBCACHE_POLICY_COMPRESS_AT``  where the policy's default budget compresses
``OBCACHE_POLICY_QUERY_AGNOSTIC`` the selection a query-agnostic request gets (or null)
``OBCACHE_ENTRY_POOL_SHARE``    the pool share compressed contexts hold against waiting work
``OBCACHE_ENTRY_POOL_SHARE_MAX`` the share they may hold while nothing waits
``OBCACHE_ENTRY_VICTIMS``       which held compressed context gives way first
``OBCACHE_VLLM_HOME``           where models and wheels are cached
``OBCACHE_VLLM_VERIFY``         the KV oracle (``1``: on; tests)
``OBCACHE_VLLM_RECORD_KEEP``    the worker records kept positions (``1``; tests)
``OBCACHE_VLLM_FAULTS``         fault injection (``1``; tests)
``OBCACHE_VLLM_PLUGIN_TRACE``   a file each process appends what the plugin did to (tests)
==============================  ============================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CONFIG = "OBCACHE_VLLM_CONFIG"
KV_PREFIX = "OBCACHE_KV_"
MIN_PROMPT_TOKENS = "OBCACHE_MIN_PROMPT_TOKENS"
POLICY_COMPRESS_AT = "OBCACHE_POLICY_COMPRESS_AT"
POLICY_QUERY_AGNOSTIC = "OBCACHE_POLICY_QUERY_AGNOSTIC"
ENTRY_POOL_SHARE = "OBCACHE_ENTRY_POOL_SHARE"
ENTRY_POOL_SHARE_MAX = "OBCACHE_ENTRY_POOL_SHARE_MAX"
ENTRY_VICTIMS = "OBCACHE_ENTRY_VICTIMS"
HOME = "OBCACHE_VLLM_HOME"
VERIFY = "OBCACHE_VLLM_VERIFY"
RECORD_KEEP = "OBCACHE_VLLM_RECORD_KEEP"
FAULTS = "OBCACHE_VLLM_FAULTS"
PLUGIN_TRACE = "OBCACHE_VLLM_PLUGIN_TRACE"

NAMES = (CONFIG, MIN_PROMPT_TOKENS, POLICY_COMPRESS_AT, POLICY_QUERY_AGNOSTIC, ENTRY_POOL_SHARE,
         ENTRY_POOL_SHARE_MAX, ENTRY_VICTIMS, HOME, VERIFY, RECORD_KEEP, FAULTS,
         PLUGIN_TRACE)  # fmt: skip


def value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The raw value of ``name`` (one of :data:`NAMES`, or a ``KV_PREFIX`` name), or None."""
    if name not in NAMES and not name.startswith(KV_PREFIX):
        raise KeyError(f"{name} is not an obcache-vllm variable")
    return (os.environ if environ is None else environ).get(name)


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether switch ``name`` is on (``1``)."""
    return value(name, environ) == "1"


def kv_name(field: str) -> str:
    """``kv_budget`` -> ``OBCACHE_KV_BUDGET``."""
    return KV_PREFIX + field.removeprefix("kv_").upper()


def kv_defaults(fields, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server defaults the environment sets for ``fields`` (kv_* names), raw."""
    out = {}
    for name in fields:
        raw = value(kv_name(name), environ)
        if raw is not None:
            out[name] = raw
    return out


def home(environ: Mapping[str, str] | None = None) -> Path:
    """The cache directory of models and wheels: ``$OBCACHE_VLLM_HOME``, else
    ``$XDG_CACHE_HOME/obcache-vllm``, else ``~/.cache/obcache-vllm``."""
    env = os.environ if environ is None else environ
    if value(HOME, env):
        return Path(env[HOME]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "obcache-vllm"
