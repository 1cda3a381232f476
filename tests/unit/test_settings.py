"""Every ``OBCACHE_*`` variable is named and read in one module, ``obcache_vllm/settings.py``.

A module that spells a variable's name in code (not in its docs) or reads one from the
environment itself would be a second place a reader has to find; this test finds them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from obcache_vllm import settings

PACKAGE = Path(settings.__file__).resolve().parent
NAME = re.compile(r"^OBCACHE_[A-Z_]+$")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def test_variable_names_are_spelled_only_in_settings():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "settings.py" and path.parent == PACKAGE:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docs and NAME.match(node.value)):  # fmt: skip
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.value}")
    assert not found, "OBCACHE_* names outside obcache_vllm/settings.py:\n" + "\n".join(found)


def test_no_module_reads_an_obcache_variable_from_the_environment_itself():
    """``os.environ.get(X)`` / ``os.getenv(X)`` / ``environ[X]`` with X a settings name."""
    names = {n for n in dir(settings) if n.isupper() and isinstance(getattr(settings, n), str)}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "settings.py" and path.parent == PACKAGE:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                   and _is_setting(node.value, names, set()) for t in node.targets
                   if isinstance(t, ast.Name)}  # fmt: skip
        aliases |= {a.asname or a.name for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) for a in node.names
                    if a.name.endswith("_ENV") or a.name in names}  # fmt: skip
        for node in ast.walk(tree):
            arg = None
            if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("get", "getenv"):
                    arg = node.args[0]
            elif isinstance(node, ast.Subscript):
                arg = node.slice
            if arg is not None and _is_setting(arg, names, aliases):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, found


def _is_setting(node, names: set[str], aliases: set[str]) -> bool:
    """``settings.NAME``, or a name bound to one (``VERIFY_ENV = settings.VERIFY``)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id == "settings" and node.attr in names
    return isinstance(node, ast.Name) and node.id in aliases


def test_the_readers():
    env = {settings.VERIFY: "1", settings.kv_name("kv_budget"): "0.25", "OBCACHE_KV_WINDOW": "8",
           settings.HOME: "/tmp/obh"}  # fmt: skip
    assert settings.flag(settings.VERIFY, env) and not settings.flag(settings.FAULTS, env)
    assert settings.kv_defaults(["kv_budget", "kv_window", "kv_scorer"], env) == {
        "kv_budget": "0.25", "kv_window": "8"}  # fmt: skip
    assert settings.home(env) == Path("/tmp/obh")
    assert settings.home({"XDG_CACHE_HOME": "/x"}) == Path("/x/obcache-vllm")
    try:
        settings.value("OBCACHE_TYPO")
    except KeyError as exc:
        assert "OBCACHE_TYPO" in str(exc)
    else:
        raise AssertionError("an unknown name must not read as unset")
