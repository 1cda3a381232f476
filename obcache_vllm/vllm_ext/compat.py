"""The seam tables checked statically against a vLLM release that is not installed.

:mod:`.seams` checks the registry's rows (as the tables SEAMS / CUDA_SEAMS / ATTRIBUTES /
STATE) by importing the installed vLLM. To see before an upgrade what would break, this reads
the ``.py`` files of a wheel (a zip) or a source tree with :mod:`ast` and imports nothing
(stdlib only):

    python -m obcache_vllm.vllm_ext.compat --vllm 0.33.0 [--wheel PATH] [--out DIR]

Without ``--wheel``, ``pip download --no-deps vllm==VERSION`` fetches the wheel into
``wheels/`` of the cache home (``$OBCACHE_VLLM_HOME``, as for models; reused when there). The
installed vLLM's tree (found by ``importlib.util.find_spec``, which runs no vLLM code) is read
too, for comparison. Writes ``DIR/compat-VERSION.md`` (each seam's status in both, where missing
names moved; text below :data:`NOTES_MARKER` survives a rewrite) and ``.json``. Exit status 0
even when seams moved (a report), 2 when the tool fails.

Found means: module ``vllm.a.b`` is ``vllm/a/b.py`` or ``vllm/a/b/__init__.py``; the name is
defined (def, class, assignment, also under ``if``/``try``) or imported (``from .x import N``
and ``from vllm.x import N as M`` are followed), a class member possibly in a base (getattr
follows the MRO). Parameters are read as ``inspect.signature`` lists them (``self`` included,
a classmethod's ``cls`` not) and the table's must lead. STATE: an annotated class field, a
property, or ``self.X =`` / ``self.X:`` in ``__init__``. A missing name found elsewhere as a
top-level class or function of the same name (for ``Class.member``, the class) is ``moved``.
The report also shows where a full signature changed behind the table's leading names (a
parameter vLLM now passes can break an override that takes exactly the old ones).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from obcache_vllm import settings

STATUSES = ("ok", "params-changed", "missing", "moved")
NOTES_MARKER = "<!-- notes: everything below this line is kept when the report is regenerated -->"
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_DEPTH = 12  # re-export chains and base classes followed at most this deep


@dataclass(frozen=True)
class Row:
    table: str
    module: str
    qualname: str
    status: str  # one of STATUSES
    detail: str = ""
    moved_to: str = ""  # "module:qualname" when moved
    signature: tuple[str, ...] | None = None  # every parameter found (where the name now is)


@dataclass(frozen=True)
class Hit:
    module: str  # where the binding statement is
    node: ast.AST  # the binding statement, or an ast.Module when the name is a module


def tables(version: str | None = None) -> dict[str, tuple]:
    """The seam registry's rows as four tables: SEAMS (as they stand in vLLM ``version``),
    CUDA_SEAMS, ATTRIBUTES, STATE (seams.py imports no vLLM)."""
    from obcache_vllm.vllm_ext import seams

    rows = seams.SEAMS if version is None else seams.seams_for(version)
    return {"SEAMS": rows, "CUDA_SEAMS": seams.CUDA_SEAMS,
            "ATTRIBUTES": seams.ATTRIBUTES, "STATE": seams.STATE}


def _targets(node: ast.AST) -> list[ast.AST]:
    out = list(node.targets) if isinstance(node, ast.Assign) else [node.target]
    return [e for t in out for e in (t.elts if isinstance(t, ast.Tuple | ast.List) else [t])]


def _bindings(body: list[ast.stmt]) -> dict[str, list[ast.stmt]]:
    """Name -> the statements of ``body`` that bind it (descending into if/try/with)."""
    out: dict[str, list[ast.stmt]] = {}
    for node in body:
        if isinstance(node, _DEFS):
            out.setdefault(node.name, []).append(node)
            continue
        names: list[str] = []
        if isinstance(node, ast.Assign | ast.AnnAssign):
            names = [t.id for t in _targets(node) if isinstance(t, ast.Name)]
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [(a.asname or a.name).split(".")[0] for a in node.names]
        for name in names:
            out.setdefault(name, []).append(node)
        inner = [s for f in ("body", "orelse", "finalbody") for s in getattr(node, f, [])]
        inner += [s for h in getattr(node, "handlers", []) for s in h.body]
        for name, nodes in _bindings(inner).items():
            out.setdefault(name, []).extend(nodes)
    return out


def _best(nodes: list[ast.stmt]) -> ast.stmt:
    """A definition beats an import beats an assignment (``X = None`` fallbacks)."""
    rank = {ast.Import: 1, ast.ImportFrom: 1, ast.Assign: 2, ast.AnnAssign: 2}
    return min(nodes, key=lambda n: rank.get(type(n), 0))


def _module_of(path: str) -> str:
    return path[:-3].replace("/", ".").removesuffix(".__init__")


class Tree:
    """The ``vllm/`` sources of a wheel, or of a directory (``.../vllm`` or its parent)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        self._root = path.parent if path.name == "vllm" and self._zip is None else path
        if self._zip is None and not (self._root / "vllm" / "__init__.py").is_file():
            raise FileNotFoundError(f"no vllm/__init__.py under {path}")
        names = self._zip.namelist() if self._zip else [
            p.relative_to(self._root).as_posix() for p in (self._root / "vllm").rglob("*.py")]
        self.files = frozenset(n for n in names if n.startswith("vllm/") and n.endswith(".py"))
        self._raw: dict[str, bytes] = {}
        self._ast: dict[str, tuple[ast.Module, dict] | None] = {}

    def file_of(self, module: str) -> str | None:
        base = module.replace(".", "/")
        return next((f for f in (f"{base}.py", f"{base}/__init__.py") if f in self.files), None)

    def read(self, path: str) -> bytes:
        if path not in self._raw:
            self._raw[path] = (self._zip.read(path) if self._zip
                               else (self._root / path).read_bytes())
        return self._raw[path]

    def parse(self, module: str) -> tuple[ast.Module, dict[str, list[ast.stmt]]] | None:
        """The module's AST and its top-level bindings; None when absent or unparsable."""
        if module not in self._ast:
            path, self._ast[module] = self.file_of(module), None
            if path is not None:
                try:
                    tree = ast.parse(self.read(path))
                    self._ast[module] = (tree, _bindings(tree.body))
                except SyntaxError:
                    pass
        return self._ast[module]

    def version(self) -> str:
        m = re.search(rb"__version__ = (?:version = )?['\"]([^'\"]+)", self.read(
            "vllm/_version.py")) if "vllm/_version.py" in self.files else None
        return m.group(1).decode() if m else "unknown"

    # -- resolution -------------------------------------------------------------------------

    def lookup(self, module: str, qualname: str | list[str], depth: int = 0) -> Hit | None:
        """``qualname`` in ``module``: its binding, followed through imports and aliases."""
        parts = qualname.split(".") if isinstance(qualname, str) else qualname
        parsed = self.parse(module)
        if parsed is None or depth > _DEPTH:
            return None
        tree, names = parsed
        if parts[0] not in names:  # a submodule is an attribute path even when not imported
            sub = f"{module}.{parts[0]}"
            if self.file_of(sub) is None:
                return None
            return self.lookup(sub, parts[1:], depth + 1) if parts[1:] else Hit(sub, tree)
        node = _best(names[parts[0]])
        if isinstance(node, ast.ImportFrom):
            alias = next(a for a in node.names if (a.asname or a.name) == parts[0])
            src = self._from_module(module, node)
            if self.file_of(src) is None and not src.startswith("vllm"):
                return Hit(module, node)  # from a third-party package: exists, not followed
            sub = f"{src}.{alias.name}"
            if self.file_of(sub) and alias.name not in (self.parse(src) or ({}, {}))[1]:
                return self.lookup(sub, parts[1:], depth + 1) if parts[1:] else Hit(sub, node)
            return self.lookup(src, [alias.name, *parts[1:]], depth + 1)
        if isinstance(node, ast.Import):
            alias = next(a for a in node.names if (a.asname or a.name).split(".")[0] == parts[0])
            target = alias.name if alias.asname else parts[0]
            return self.lookup(target, parts[1:], depth + 1) if parts[1:] else Hit(module, node)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            if node.value.id != parts[0]:  # `Alias = Name`: follow the alias
                return self.lookup(module, [node.value.id, *parts[1:]], depth + 1)
        if not parts[1:]:
            return Hit(module, node)
        return self._member(module, node, parts[1:], depth + 1) if isinstance(
            node, ast.ClassDef) else None

    def _from_module(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        pkg = module.split(".")
        if not (self.file_of(module) or "").endswith("__init__.py"):
            pkg = pkg[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        return ".".join(pkg + ([node.module] if node.module else []))

    def bases(self, module: str, cls: ast.ClassDef, depth: int) -> list[Hit]:
        """The bases of ``cls`` that resolve statically to classes."""
        out = []
        for base in cls.bases:
            dotted: list[str] = []
            while isinstance(base, ast.Attribute):
                dotted.insert(0, base.attr)
                base = base.value
            hit = self.lookup(module, [base.id, *dotted], depth + 1) if isinstance(
                base, ast.Name) and depth < _DEPTH else None
            if hit is not None and isinstance(hit.node, ast.ClassDef):
                out.append(hit)
        return out

    def _member(self, module: str, cls: ast.ClassDef, parts: list[str], depth: int) -> Hit | None:
        nodes = _bindings(cls.body).get(parts[0])
        if nodes:
            node = _best(nodes)
            if not parts[1:]:
                return Hit(module, node)
            return self._member(module, node, parts[1:], depth + 1) if isinstance(
                node, ast.ClassDef) else None
        for base in self.bases(module, cls, depth):
            hit = self._member(base.module, base.node, parts, depth + 1)
            if hit is not None:
                return hit
        return None

    def signature(self, hit: Hit) -> tuple[str, ...] | None:
        """Parameter names as ``inspect.signature`` lists them; None when not a def."""
        node = hit.node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return None
        a = node.args
        names = [p.arg for p in [*a.posonlyargs, *a.args]] + ([a.vararg.arg] if a.vararg else [])
        names += [p.arg for p in a.kwonlyargs] + ([a.kwarg.arg] if a.kwarg else [])
        if any(getattr(d, "id", None) == "classmethod" for d in node.decorator_list):
            names = names[1:]  # getattr(cls, name) is bound: inspect drops cls
        return tuple(names)

    def has_state(self, module: str, cls: ast.ClassDef, attr: str, depth: int = 0) -> bool:
        """A field, property or ``self.attr`` assignment in ``__init__`` of cls or a base."""
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == attr:
                return True
            if not isinstance(node, ast.FunctionDef):
                continue
            if node.name == attr and any(getattr(d, "id", getattr(d, "attr", None)) in (
                    "property", "cached_property") for d in node.decorator_list):
                return True
            if node.name == "__init__":
                for sub in ast.walk(node):
                    targets = _targets(sub) if isinstance(sub, ast.Assign | ast.AnnAssign) else (
                        [sub.target] if isinstance(sub, ast.AugAssign) else [])
                    if any(isinstance(t, ast.Attribute) and t.attr == attr
                           and getattr(t.value, "id", None) == "self" for t in targets):
                        return True
        return depth < _DEPTH and any(self.has_state(b.module, b.node, attr, depth + 1)
                                      for b in self.bases(module, cls, depth))

    # -- where a missing name went ----------------------------------------------------------

    def defined_in(self, name: str) -> list[str]:
        """Modules whose top level defines a class or function ``name`` (imports do not count;
        a regex picks the files worth parsing)."""
        pattern = re.compile(rb"^(?:async\s+)?(?:def|class)\s+%s\b" % re.escape(name.encode()),
                             re.M)
        out = []
        for path in sorted(self.files):
            if pattern.search(self.read(path)):
                parsed = self.parse(_module_of(path))
                if parsed and any(isinstance(n, _DEFS) for n in parsed[1].get(name, [])):
                    out.append(_module_of(path))
        return out

    def relocate(self, module: str, qualname: str) -> tuple[str, Hit] | None:
        """Where ``module.qualname`` went, as ("module:qualname", hit): its outer class defined
        elsewhere, else a top-level def of the same final name (not for dunders). Candidates
        nearer to ``module`` in the package tree come first."""
        parts = qualname.split(".")
        tries = [(m, qualname) for m in self.defined_in(parts[0])] if parts[1:] else []
        if not parts[-1].startswith("__"):
            tries += [(m, parts[-1]) for m in self.defined_in(parts[-1])]
        near = module.split(".")
        tries.sort(key=lambda t: -len(os.path.commonprefix([t[0].split("."), near])))
        for m, q in tries:
            hit = self.lookup(m, q) if m != module else None
            if hit is not None and isinstance(hit.node, _DEFS):
                return f"{m}:{q}", hit
        return None


def _missing(tree: Tree, table: str, module: str, qualname: str, params: tuple | None,
             attr: str | None = None) -> Row:
    """The row of a name not found where the table says (``moved`` when :meth:`Tree.relocate`
    finds it); for STATE, ``qualname`` is the class and ``attr`` the attribute."""
    name = f"{qualname}.{attr}" if attr else qualname
    why = "module not found" if tree.parse(module) is None else f"{qualname} not found"
    found = tree.relocate(module, qualname)
    if found is None:
        return Row(table, module, name, "missing", why)
    where, hit = found
    detail, names = f"{why}; moved to {where}", tree.signature(hit)
    if params is not None and names is not None:
        same = names[: len(params)] == tuple(params)
        detail += "; parameters unchanged" if same else f"; parameters now {names}"
    if attr and isinstance(hit.node, ast.ClassDef):
        has = tree.has_state(hit.module, hit.node, attr)
        detail += f"; {attr} {'still set' if has else 'not set'} there"
    return Row(table, module, name, "moved", detail, where + (f".{attr}" if attr else ""), names)


def check_tree(tree: Tree, tbl: dict[str, tuple] | None = None) -> list[Row]:
    """One row per seam, attribute and state attribute of ``tbl`` (default :func:`tables`)."""
    tbl = tables() if tbl is None else tbl
    rows: list[Row] = []
    for table in ("SEAMS", "CUDA_SEAMS"):
        for module, qualname, params in tbl[table]:
            hit = tree.lookup(module, qualname)
            if hit is None:
                rows.append(_missing(tree, table, module, qualname, tuple(params)))
                continue
            names = tree.signature(hit)
            notes = [f"defined in {hit.module}"] if hit.module != module else []
            status = "ok"
            if names is None:
                notes.append("not a def: parameters not read")
            elif names[: len(params)] != tuple(params):
                status = "params-changed"
                notes.insert(0, f"parameters {names}, expected {tuple(params)}")
            rows.append(Row(table, module, qualname, status, "; ".join(notes), "", names))
    for module, name in tbl["ATTRIBUTES"]:
        found = tree.lookup(module, name) is not None
        rows.append(Row("ATTRIBUTES", module, name, "ok") if found
                    else _missing(tree, "ATTRIBUTES", module, name, None))
    for module, cls_name, attrs in tbl["STATE"]:
        hit = tree.lookup(module, cls_name)
        for attr in attrs:
            if hit is None or not isinstance(hit.node, ast.ClassDef):
                rows.append(_missing(tree, "STATE", module, cls_name, None, attr))
            else:
                ok = tree.has_state(hit.module, hit.node, attr)
                rows.append(Row("STATE", module, f"{cls_name}.{attr}", "ok" if ok else "missing",
                                "" if ok else f"{attr} not set on {cls_name}"))
    return rows


def fetch_wheel(version: str, cache: Path | None = None) -> Path:
    """The vLLM ``version`` wheel in the cache, downloaded by pip when not there yet."""
    cache = settings.home() / "wheels" if cache is None else cache
    cache.mkdir(parents=True, exist_ok=True)
    if not sorted(cache.glob(f"vllm-{version}-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        f"vllm=={version}", "-d", str(cache)], check=True)
    wheels = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download put no vllm-{version} wheel in {cache}")
    return wheels[0]


def installed_tree() -> Path | None:
    """site-packages/vllm of the installed vLLM, located without importing it."""
    spec = importlib.util.find_spec("vllm")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def report(version: str, other: list[Row], installed: list[Row], base: str) -> str:
    """The markdown table: each row's status in the installed vLLM and in ``version``."""
    mine = {(r.table, r.module, r.qualname): r for r in installed}
    lines = [f"# vLLM {version} against the seam tables (installed: vLLM {base})", "",
             f"Generated by `python -m obcache_vllm.vllm_ext.compat --vllm {version}`: a static "
             "reading of both source trees, nothing imported (rules: the module's docstring).",
             "", f"| status | {base} (installed) | {version} |", "|---|---|---|"]
    lines += [f"| {s} | {sum(r.status == s for r in installed)} | "
              f"{sum(r.status == s for r in other)} |" for s in STATUSES]
    lines += ["", f"| table | module | name | {base} | {version} | {version}: detail, moved to |",
              "|---|---|---|---|---|---|"]
    for r in other:
        was = mine.get((r.table, r.module, r.qualname))
        detail = [r.detail] if r.detail else []
        if was and was.signature and r.signature and was.signature != r.signature:
            detail.append(f"full signature was {was.signature}, now {r.signature}")
        mark = lambda s: s if s == "ok" else f"**{s}**"  # noqa: E731
        lines.append(f"| {r.table} | `{r.module}` | `{r.qualname}` | "
                     f"{mark(was.status) if was else 'n/a'} | {mark(r.status)} | "
                     + "; ".join(detail).replace("|", "\\|") + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m obcache_vllm.vllm_ext.compat",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", required=True, metavar="VERSION", help="the release to check")
    parser.add_argument("--wheel", type=Path, help="its wheel or source tree (default: pip)")
    parser.add_argument("--out", type=Path, default=Path("results/compat"))
    args = parser.parse_args(argv)
    try:
        tree = Tree(args.wheel or fetch_wheel(args.vllm))
        # The other release against its own rows (VERSIONED_SEAMS), and against 0.32's.
        other = check_tree(tree, tables(args.vllm))
        unversioned = check_tree(tree, tables())
        mine = Tree(installed_tree()) if installed_tree() else None
        installed = check_tree(mine, tables(mine.version())) if mine else []
        base = mine.version() if mine else "not installed"
        args.out.mkdir(parents=True, exist_ok=True)
        md = args.out / f"compat-{args.vllm}.md"
        notes = md.read_text().partition(NOTES_MARKER)[2] if md.exists() else ""
        md.write_text(report(args.vllm, other, installed, base)
                      + (f"\n{NOTES_MARKER}{notes}" if notes else ""))
        (args.out / f"compat-{args.vllm}.json").write_text(json.dumps({
            "vllm": args.vllm, "wheel_version": tree.version(), "installed_vllm": base,
            "rows": [asdict(r) for r in other], "installed_rows": [asdict(r) for r in installed],
            "rows_without_versioned_seams": [asdict(r) for r in unversioned],
        }, indent=1) + "\n")
    except (OSError, ValueError, zipfile.BadZipFile, subprocess.CalledProcessError) as exc:
        print(f"compat: {exc!r}", file=sys.stderr)
        return 2
    print(f"vLLM {args.vllm}: {({s: sum(r.status == s for r in other) for s in STATUSES})}"
          f" (installed {base}); report: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
