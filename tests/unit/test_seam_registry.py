"""The seam registry is the one place that patches vLLM, and its rows are well formed.

Read statically (no vLLM import): every module of the package except ``seams.py`` is parsed,
and none may replace an attribute that a registry row applies or binds, call vLLM's
``register_backend``, or patch with ``setattr`` on a class or module. The rows' resolution
against the installed vLLM, and the completeness of the ``override`` rows, are in
``tests/vllm/test_seam_registry_vllm.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from obcache_vllm.vllm_ext import seams
from obcache_vllm.vllm_ext.wire import STATS_ATTR

pytestmark = pytest.mark.unit

PACKAGE = Path(seams.__file__).resolve().parents[1]
REGISTRY_FILE = Path(seams.__file__).resolve()
# Attribute names whose assignment would be a patch: the final name of every row that is
# installed (wrap, replace, field, backend) or bound (instance).
PATCHED_NAMES = {r.qualname.rsplit(".", 1)[-1] for r in seams.REGISTRY
                 if r.how in (*seams.APPLIED, "instance")}  # fmt: skip


def patches_outside_the_registry(source: str, path: str) -> list[str]:
    """Where ``source`` patches vLLM on its own: an assignment to a registry-installed name,
    a ``setattr`` of one, or a call of ``register_backend`` / ``patch_method``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr in PATCHED_NAMES:
                found.append(f"{path}:{node.lineno}: assigns .{target.attr}")
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in ("register_backend", "patch_method"):
                found.append(f"{path}:{node.lineno}: calls {name}")
            if name == "setattr" and len(node.args) >= 2:
                attr = node.args[1]
                if isinstance(attr, ast.Constant) and attr.value in PATCHED_NAMES:
                    found.append(f"{path}:{node.lineno}: setattr of {attr.value}")
    return found


def test_no_module_but_the_registry_patches_vllm():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.resolve() != REGISTRY_FILE:
            found += patches_outside_the_registry(path.read_text(), str(path.relative_to(PACKAGE)))
    assert not found, "patch through obcache_vllm.vllm_ext.seams instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "broken",
    [
        "def f(manager, adapter):\n    manager.allocate_slots = adapter.allocate_slots\n",
        "def f(cpu_worker, ours):\n    cpu_worker.CPUModelRunner = ours\n",
        "def f(cls):\n    setattr(cls, 'process_inputs', None)\n",
        "def f(enum):\n    register_backend(enum.CPU_ATTN, 'x.Y')\n",
    ],
    ids=["instance-method", "module-global", "setattr", "register-backend"],
)
def test_the_scan_finds_a_patch_made_elsewhere(broken):
    assert patches_outside_the_registry(broken, "broken.py")


def test_rows_are_well_formed():
    keys = set()
    for row in seams.REGISTRY:
        assert row.how in seams.HOWS and row.process in seams.PROCESSES, row
        assert row.backend in seams.BACKENDS and row.why, row
        # The API server's rows are exactly those of its modules: a process that does not
        # serve the API neither checks nor imports them.
        assert (row.process == "server") == seams.is_server_module(row.module), row.key
        callable_row = row.how in ("wrap", "instance", "override", "call")
        assert (row.params is not None) == callable_row, row.key
        if row.how in ("wrap", "replace", "backend", "instance", "override"):
            assert row.install, f"{row.key}: nothing installed is named"
        if row.how in ("state", "field"):
            assert row.attrs, row.key
        assert (row.key, row.how) not in keys, f"{row.key} twice"
        keys.add((row.key, row.how))


def test_the_stats_field_is_the_wire_attribute():
    (row,) = [r for r in seams.REGISTRY if r.how == "field"]
    assert row.qualname == "SchedulerStats" and row.attrs == (STATS_ATTR,)


def test_bind_accepts_instance_rows_only():
    class KVCacheManager:
        def allocate_slots(self):
            return "vllm"

    manager = KVCacheManager()
    seams.bind(manager, "KVCacheManager.allocate_slots", lambda: "ours")
    assert manager.allocate_slots() == "ours" and KVCacheManager().allocate_slots() == "vllm"
    with pytest.raises(ValueError, match="not an instance row"):
        seams.bind(manager, "KVCacheManager.free", lambda: None)
    with pytest.raises(TypeError, match="not its class"):
        seams.bind(object(), "KVCacheManager.allocate_slots", lambda: None)
