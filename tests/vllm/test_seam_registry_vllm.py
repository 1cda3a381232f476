"""The seam registry against the installed vLLM: what it installs exists, and every vLLM method
our subclasses override is a row (so the start-up check covers it)."""

from __future__ import annotations

import inspect
import types

import pytest

from obcache_vllm.vllm_ext import seams

pytestmark = pytest.mark.vllm


def _ours(cls) -> bool:
    return cls.__module__.startswith("obcache_vllm")


def test_every_installed_object_exists():
    for row in seams.REGISTRY:
        if row.how in ("wrap", "replace", "override"):
            assert seams.load(row.install) is not None, row.key
        elif row.how == "instance":  # a method of ours, or the module that binds it
            assert seams.load(row.install), row.key
        elif row.how == "backend":  # vLLM's registry takes a dotted class path
            module, _, name = row.install.rpartition(".")
            assert seams.load(f"{module}:{name}"), row.key


METHODS = (types.FunctionType, classmethod, staticmethod)


def _static(module: str, qualname: str):
    """The class-dict entry a row names (a classmethod object, not a bound method)."""
    outer, _, name = qualname.rpartition(".")
    return inspect.getattr_static(seams._resolve(module, outer), name)


def overridden_without_a_row(classes) -> list[str]:
    """Methods of obcache classes that override a vLLM class's method with no override row."""
    pinned = {id(_static(r.module, r.qualname)) for r in seams.REGISTRY if r.how == "override"}
    missing = []
    for cls in classes:
        mro = inspect.getmro(cls)
        ours = [c for c in mro if _ours(c)]
        for name in {n for c in ours for n, v in vars(c).items() if isinstance(v, METHODS)}:
            if name.startswith("__") and name != "__init__":
                continue
            vllm_owner = next((c for c in mro if not _ours(c) and name in vars(c)), None)
            if vllm_owner is None or vllm_owner is object:
                continue
            if id(vars(vllm_owner)[name]) not in pinned:
                missing.append(f"{cls.__name__}.{name} overrides "
                               f"{vllm_owner.__module__}:{vllm_owner.__qualname__}.{name}")
    return missing


def test_every_override_of_a_vllm_method_is_a_row():
    classes = {seams.load(r.install) for r in seams.REGISTRY if r.how == "override"}
    classes.add(seams.load("obcache_vllm.vllm_ext.worker.backends.flash_attn:"
                           "OBCacheGPUModelRunner"))
    classes.add(seams.load("obcache_vllm.evidence.fidelity:FidelityProcessor"))
    assert len(classes) >= 6
    missing = overridden_without_a_row(classes)
    assert not missing, "\n".join(missing)


def test_the_override_check_finds_an_unpinned_override():
    from vllm.v1.core.sched.scheduler import Scheduler

    class Sneaky(Scheduler):
        def has_requests(self):  # overrides vLLM's method, pinned nowhere
            return False

    Sneaky.__module__ = "obcache_vllm_test_double"  # counts as ours (the prefix)
    assert any("has_requests" in m for m in overridden_without_a_row([Sneaky]))
