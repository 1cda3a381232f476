"""The static seam check (obcache_vllm/vllm_ext/compat.py): a fake vLLM tree, then the real one.

The fake tree (as a directory and as a zipped "wheel") has one case per rule: a method found
with matching parameters, one whose parameters changed, a function moved to another module, a
re-exported name, STATE set in ``__init__`` / as a field / as a property / in a base class, a
missing attribute. The last tests read the INSTALLED vLLM's source tree (found without importing
it): every SEAMS and CUDA_SEAMS row must resolve ``ok``, since vLLM 0.32.0 is what the tables
describe. No network, no vLLM import.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from obcache_vllm.vllm_ext import compat

FAKE = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '9.9.0'\n",
    # The package re-exports the class from a submodule (relative import).
    "vllm/core/__init__.py": "from .sched import Scheduler\n",
    "vllm/core/sched.py": """
        class Base:
            def __init__(self, a):
                self.base_attr = a

        class Scheduler(Base):
            field: int = 0

            def __init__(self, vllm_config, block_size):
                self.num_waiting = 0
                self.a, self.b = 1, 2

            def schedule(self, budget, *, throttle=False):
                pass

            def update(self, output, stats):  # the table expects (self, scheduler_output)
                pass

            @property
            def load(self):
                return 0

            @classmethod
            def make(cls, x):
                pass
        """,
    # get_configs and Planner left this module for vllm.planning.
    "vllm/core/kv_utils.py": "def other():\n    pass\n",
    "vllm/planning.py": """
        def get_configs(vllm_config, specs, memory, groups):
            pass

        class Planner:
            def __init__(self):
                self.x = 1
        """,
    # An absolute re-export under another name, inside a try block.
    "vllm/utils/__init__.py": """
        try:
            from vllm.utils.math import cdiv as ceil_div
        except ImportError:
            ceil_div = None
        """,
    "vllm/utils/math.py": "def cdiv(a, b):\n    return -(a // -b)\n",
}

TABLES = {
    "SEAMS": (
        ("vllm.core.sched", "Scheduler.schedule", ("self", "budget", "throttle")),
        ("vllm.core.sched", "Scheduler.update", ("self", "scheduler_output")),
        ("vllm.core.kv_utils", "get_configs", ("vllm_config", "specs", "memory")),
        ("vllm.utils", "ceil_div", ("a", "b")),
        ("vllm.core", "Scheduler.__init__", ("self", "vllm_config")),
        ("vllm.core.sched", "Scheduler.make", ("x",)),  # bound classmethod: no cls
    ),
    "CUDA_SEAMS": (("vllm.core.sched", "Base.__init__", ("self", "a")),),
    "ATTRIBUTES": (
        ("vllm.core.sched", "Scheduler.field"),
        ("vllm.core.sched", "Scheduler.gone"),
        ("vllm.core", "sched"),
        ("vllm.nowhere", "Thing"),
    ),
    "STATE": (
        ("vllm.core.sched", "Scheduler",
         ("num_waiting", "b", "field", "load", "base_attr", "nope")),
        ("vllm.core.kv_utils", "Planner", ("x",)),
    ),
}


def _write_tree(root: Path) -> Path:
    for rel, text in FAKE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture(params=["directory", "wheel"])
def fake(request, tmp_path) -> Path:
    tree = _write_tree(tmp_path / "src")
    if request.param == "directory":
        return tree / "vllm"  # the package folder itself is accepted too
    wheel = tmp_path / "vllm-9.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for rel in FAKE:
            zf.write(tree / rel, rel)
    return wheel


def _rows(path: Path) -> dict[tuple[str, str], compat.Row]:
    return {(r.table, r.qualname): r for r in compat.check_tree(compat.Tree(path), TABLES)}


def test_fake_tree_resolves_each_case(fake) -> None:
    rows = _rows(fake)
    assert compat.Tree(fake).version() == "9.9.0"
    assert rows["SEAMS", "Scheduler.schedule"].status == "ok"
    changed = rows["SEAMS", "Scheduler.update"]
    assert changed.status == "params-changed" and "('self', 'output', 'stats')" in changed.detail
    moved = rows["SEAMS", "get_configs"]
    assert moved.status == "moved" and moved.moved_to == "vllm.planning:get_configs"
    assert "parameters unchanged" in moved.detail
    assert moved.signature == ("vllm_config", "specs", "memory", "groups")
    reexport = rows["SEAMS", "ceil_div"]
    assert reexport.status == "ok" and reexport.detail == "defined in vllm.utils.math"
    assert rows["SEAMS", "Scheduler.__init__"].detail == "defined in vllm.core.sched"
    assert rows["SEAMS", "Scheduler.make"].status == "ok"
    assert rows["CUDA_SEAMS", "Base.__init__"].status == "ok"
    assert rows["ATTRIBUTES", "Scheduler.field"].status == "ok"
    assert rows["ATTRIBUTES", "sched"].status == "ok"  # a submodule is an attribute
    assert rows["ATTRIBUTES", "Scheduler.gone"].status == "missing"
    assert rows["ATTRIBUTES", "Thing"].detail == "module not found"
    for attr in ("num_waiting", "b", "field", "load", "base_attr"):
        assert rows["STATE", f"Scheduler.{attr}"].status == "ok", attr
    assert rows["STATE", "Scheduler.nope"].status == "missing"
    planner = rows["STATE", "Planner.x"]
    assert planner.status == "moved" and planner.moved_to == "vllm.planning:Planner.x"
    assert "x still set there" in planner.detail
    assert {r.status for r in rows.values()} <= set(compat.STATUSES)


def test_main_writes_the_report_keeps_notes_and_fails_on_tool_errors(fake, tmp_path) -> None:
    out = tmp_path / "out"
    assert compat.main(["--vllm", "9.9.0", "--wheel", str(fake), "--out", str(out)]) == 0
    md = out / "compat-9.9.0.md"
    data = json.loads((out / "compat-9.9.0.json").read_text())
    assert data["wheel_version"] == "9.9.0" and data["rows"]
    assert {r["status"] for r in data["rows"]} <= set(compat.STATUSES)
    assert "| table | module | name |" in md.read_text()
    # Notes written below the marker survive a rewrite.
    md.write_text(md.read_text() + f"\n{compat.NOTES_MARKER}\n## hand-written\n")
    assert compat.main(["--vllm", "9.9.0", "--wheel", str(fake), "--out", str(out)]) == 0
    assert md.read_text().count("## hand-written") == 1
    assert compat.main(["--vllm", "9.9.0", "--wheel", str(tmp_path / "none"),
                        "--out", str(out)]) == 2


def test_tables_and_module_import_neither_vllm_nor_torch() -> None:
    code = ("import sys, obcache_vllm.vllm_ext.compat as c; t = c.tables(); "
            "print(len(t['CUDA_SEAMS'])); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert int(out[0]) >= 1 and out[1] == "[]"


def test_installed_vllm_matches_the_tables_exactly() -> None:
    tree = compat.installed_tree()
    if tree is None:
        pytest.skip("vLLM not installed")
    loaded = "vllm" in sys.modules
    assert importlib.util.find_spec("vllm") is not None
    rows = compat.check_tree(compat.Tree(tree))
    assert ("vllm" in sys.modules) == loaded  # read, not imported
    tables = compat.tables()
    for table in ("SEAMS", "CUDA_SEAMS"):
        mine = [r for r in rows if r.table == table]
        assert len(mine) == len(tables[table]) > 0
        bad = [r for r in mine if r.status != "ok"]
        assert not bad, bad
