"""The one way obcache-vllm replaces a vLLM function: wrap it once, mark it, never twice."""

from __future__ import annotations


def patch_method(owner, name: str, wrapper) -> None:
    """Replace ``owner.name`` by ``wrapper(original)`` unless it is already our wrapper.

    Wrappers set ``__obcache_wrapped__ = True`` on the function they return; plugins load once per
    process but ``install`` may run again (tests, several engines), and a double wrap would
    validate or count a request twice.
    """
    current = getattr(owner, name)
    if getattr(current, "__obcache_wrapped__", False):
        return
    setattr(owner, name, wrapper(current))
