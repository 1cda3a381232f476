"""The documentation site (docs/, mkdocs.yml) and README.md: a strict build and sound references.

* the site builds with ``mkdocs build --strict`` (broken links, anchors, snippets and API
  references are errors), and serves every ``results/`` file the pages link to;
* every ``results/...`` file the pages include (``--8<--``), link or name in inline code exists;
* every ``vllm:obcache_*`` metric named in the docs or the README is one obcache_vllm.metrics
  defines;
* the README stays short; no link leaves the repository or names a file it does not have.

No network, no vLLM import.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from obcache_vllm import metrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200
# Files other documents of the project's history refer to; this repository has none of them.
ABSENT = ("DESIGN.md", "PAPER.md", "VLLM_MAP.md")

FENCE = re.compile(r"^([ \t]*)(```|~~~).*?^\1\2[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")
SNIPPET = re.compile(r"""^\s*-{1,}8<-{1,}\s+["']([^"']+)["']""", re.M)
RESULTS_FILE = re.compile(r"^results/[\w./-]+\.\w+$")
METRIC = re.compile(r"vllm:obcache_[a-z_]+")


def _markdown_files() -> list[Path]:
    return sorted(DOCS.rglob("*.md")) + [README]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _without_code(text: str) -> str:
    """The text with fenced blocks and inline code removed (their content is not a link)."""
    return INLINE_CODE.sub("code", FENCE.sub("", text))


def _links(path: Path) -> list[str]:
    """Every link target of a Markdown file (inline, reference-style, HTML), outside code."""
    text = _without_code(path.read_text(encoding="utf-8"))
    return [
        m.group(1)
        for pattern in (INLINE_LINK, REF_LINK, HTML_LINK)
        for m in pattern.finditer(text)
    ]


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)) and not target.startswith("file:")


def _resolve(path: Path, target: str) -> str | None:
    """The repository path (posix, normalized) a relative link target names, or None."""
    target = target.split("#", 1)[0].split("?", 1)[0]
    if not target or _is_external(target):
        return None
    return posixpath.normpath(posixpath.join(posixpath.dirname(_rel(path)), target))


def _snippets(path: Path) -> list[str]:
    """Files included with pymdownx.snippets (base path: the repository root), ranges cut."""
    text = path.read_text(encoding="utf-8")
    return [m.group(1).split(":", 1)[0] for m in SNIPPET.finditer(text)]


def _results_links() -> dict[str, list[str]]:
    """results/ file -> the Markdown files that link to it."""
    found: dict[str, list[str]] = {}
    for path in _markdown_files():
        for target in _links(path):
            resolved = _resolve(path, target)
            if resolved and resolved.startswith("results/"):
                found.setdefault(resolved, []).append(_rel(path))
    return found


def _mkdocs() -> str | None:
    candidate = Path(sys.executable).with_name("mkdocs")
    if candidate.is_file():
        return str(candidate)
    return shutil.which("mkdocs")


def test_the_site_builds_strictly_and_serves_the_linked_results(tmp_path: Path) -> None:
    mkdocs = _mkdocs()
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (the dev extra: mkdocs-material, mkdocstrings)")
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT,  # pymdownx.snippets resolves --8<-- paths from the working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").is_file()
    missing = [target for target in _results_links() if not (site / target).is_file()]
    assert not missing, f"linked results/ files not in the built site: {missing}"
    # Wide result tables wrap in the page instead of scrolling columns out of sight: every
    # page carries the stylesheet that says so (docs/stylesheets/extra.css).
    css = (site / "stylesheets" / "extra.css").read_text()
    assert ".md-typeset__table table:not([class])" in css and "overflow-wrap: anywhere" in css
    page = (site / "evidence" / "fidelity" / "index.html").read_text()
    assert "stylesheets/extra.css" in page


def test_every_included_or_linked_results_file_exists() -> None:
    missing = []
    for path in _markdown_files():
        for target in _snippets(path):
            if target.startswith("results/") and not (ROOT / target).is_file():
                missing.append(f"{_rel(path)}: --8<-- {target}")
    for target, pages in _results_links().items():
        if not (ROOT / target).is_file():
            missing.append(f"{', '.join(pages)}: link to {target}")
    assert not missing, "\n".join(missing)


def test_every_results_file_named_in_inline_code_exists() -> None:
    missing = []
    for path in _markdown_files():
        text = FENCE.sub("", path.read_text(encoding="utf-8"))
        for m in INLINE_CODE.finditer(text):
            name = m.group(2).strip()
            if RESULTS_FILE.match(name) and not (ROOT / name).is_file():
                missing.append(f"{_rel(path)}: `{name}`")
    assert not missing, "\n".join(missing)


def test_every_metric_named_is_one_obcache_vllm_defines() -> None:
    known: set[str] = set()
    for m in metrics.METRICS:
        known |= {m.name, m.exposed}
        if m.kind == "histogram":
            known |= {f"{m.name}{suffix}" for suffix in ("_bucket", "_sum", "_count")}
    unknown = sorted(
        f"{_rel(path)}: {name}"
        for path in _markdown_files()
        for name in set(METRIC.findall(path.read_text(encoding="utf-8")))
        if name not in known
    )
    assert not unknown, "metrics not in obcache_vllm.metrics:\n" + "\n".join(unknown)


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most 200)"


def test_no_link_leaves_the_repository_or_names_an_absent_file() -> None:
    bad = []
    for path in _markdown_files():
        links = [(t, _resolve(path, t)) for t in _links(path)]
        snippets = [(t, posixpath.normpath(t)) for t in _snippets(path)]  # from the root
        for target, resolved in links + snippets:
            if Path(target.split("#", 1)[0]).name in ABSENT:
                bad.append(f"{_rel(path)}: {target} (not in this repository)")
            elif target.startswith(("file:", "/", "~")):
                bad.append(f"{_rel(path)}: {target} (absolute path)")
            elif resolved is not None and (resolved == ".." or resolved.startswith("../")):
                bad.append(f"{_rel(path)}: {target} (outside the repository)")
    assert not bad, "\n".join(bad)


def test_every_relative_markdown_link_resolves() -> None:
    broken = []
    for path in _markdown_files():
        for target in _links(path):
            resolved = _resolve(path, target)
            if resolved is None or not resolved.endswith(".md"):
                continue
            if not (ROOT / resolved).is_file():
                broken.append(f"{_rel(path)}: {target}")
    assert not broken, "\n".join(broken)


# Working notes that mean nothing to a reader (who the "agents" are, which "issue", which
# "tool"): a user-facing page says what the machine and its load were in the reader's terms.
INTERNAL_PHRASES = ("agent's", "agents'", "other agents", "the issue's", "device tool",
                    "can borrow", "this session")  # fmt: skip
# Lock files serialize jobs on the development machine; only the page that explains them shows
# one (contributing/testing.md, "Benchmarking on a shared machine").
LOCK = re.compile(r"/tmp/obcache-core\d\.lock")
LOCK_PAGE = DOCS / "contributing" / "testing.md"


def _user_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_pages_speak_to_a_user_not_to_the_team() -> None:
    found = [
        f"{page.relative_to(ROOT)}:{n}: {phrase!r}"
        for page in _user_pages()
        for n, line in enumerate(page.read_text().splitlines(), start=1)
        for phrase in INTERNAL_PHRASES
        if phrase in line.lower()
    ]
    assert not found, "internal working notes on user-facing pages:\n" + "\n".join(found)


def test_commands_use_no_lock_files_outside_the_page_that_explains_them() -> None:
    found = [
        f"{page.relative_to(ROOT)}:{n}"
        for page in _user_pages()
        if page != LOCK_PAGE
        for n, line in enumerate(page.read_text().splitlines(), start=1)
        if LOCK.search(line)
    ]
    assert not found, "commands with /tmp lock files:\n" + "\n".join(found)
    assert LOCK.search(LOCK_PAGE.read_text()), "the explaining page lost its example"


# --- references to the repository's own files, modules and functions --------------------------

_REPO_DIRS = ("obcache_vllm/", "tests/", "docs/", "benchmarks/", "loadtest/", "scripts/",
              "configs/", "deploy/", "examples/", ".ci/")  # fmt: skip
_DIRS = "|".join(re.escape(p) for p in _REPO_DIRS)
_REPO_PATH = re.compile(rf"(?<![\w./-])((?:{_DIRS})[\w./-]*\w)")
_NOTE_FILE = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]+\.md)\b")
_DOTTED = re.compile(r"(?<![\w.])(obcache_vllm(?:\.\w+)+)")


def _source_files() -> list[Path]:
    skip = {".venv", "site", ".git", "results", "node_modules", "__pycache__"}
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".cfg"}
    return [
        p for p in ROOT.rglob("*")
        if p.suffix in suffixes and p.is_file() and not skip & set(p.relative_to(ROOT).parts)
    ]  # fmt: skip


def _top_level_names(path: Path) -> set[str]:
    import ast

    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _dotted_exists(name: str) -> bool:
    """``obcache_vllm.a.b[.attr]``: a module of the package, and its top-level attribute."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        for module in (base.with_suffix(".py"), base / "__init__.py"):
            if module.exists():
                rest = parts[i:]
                return not rest or rest[0].startswith("__") or rest[0] in _top_level_names(module)
    return False


def test_no_file_module_or_function_named_is_missing() -> None:
    """Docstrings, comments and pages name repository files (``tests/.../test_x.py``),
    modules and their functions (``obcache_vllm.a.b.name``): each must exist, so a moved
    test or a renamed function leaves no stale pointer behind. Working notes outside the
    repository (DESIGN.md and the like) must not be cited at all."""
    bad = []
    for path in _source_files():
        if path == Path(__file__).resolve():
            continue  # this file names the absent notes on purpose
        text = path.read_text(errors="ignore")
        for match in _REPO_PATH.finditer(text):
            target = match.group(1).rstrip(".")
            if any(c in target for c in "*{<$"):
                continue  # a pattern, not a file
            if not (ROOT / target).exists() and not any(ROOT.glob(target + "*")):
                bad.append(f"{_rel(path)}: {target}")
        for match in _NOTE_FILE.finditer(text):
            if match.group(1) in ABSENT or not any(ROOT.rglob(match.group(1))):
                bad.append(f"{_rel(path)}: {match.group(1)}")
        for match in _DOTTED.finditer(text):
            if not _dotted_exists(match.group(1).rstrip(".")):
                bad.append(f"{_rel(path)}: {match.group(1)}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_reference_pages_are_generated_from_the_code() -> None:
    """docs/reference/{cli,rest}.md are what scripts/gen_reference.py writes from the code."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_reference.py"),
                           "--check"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _figures_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A figure that looks measured: a ratio ("1.23x"), a number with two or more decimals, or a
# percentage with a decimal. On a user-facing page each carries its source (an annotation
# scripts/figures.py checks) or sits on a line naming the command that printed it; the rest are
# settings, targets, versions or approximations, each listed here with why.
MEASURED = re.compile(
    r"(?<![\w.\-/@~])(\d[\d,]*\.\d{2,}(?![\d.])|\d[\d,]*(?:\.\d+)?x\b|\d+\.\d+ ?%)")
COMMAND = re.compile(r"`[^`]*(make |python|pytest|obcache-vllm |\.venv/bin|scripts/|benchmarks/"
                     r"|loadtest|git show)[^`]*`")  # fmt: skip
UNTRACED = {  # (page, figure): how many times it may appear without a source, and why
    ("README.md", "3.11"): (1, "Python version"),
    ("docs/contributing/per_head_memory.md", "1.6x"): (1, "an input: the synthetic heads' sizes"),
    ("docs/contributing/per_head_memory.md", "1x"): (1, "an input: the synthetic heads' sizes"),
    ("docs/contributing/per_head_memory.md", "0.4x"): (1, "an input: the synthetic heads' sizes"),
    ("docs/deploying/images.md", "2.15"): (1, "hadolint's version"),
    ("docs/deploying/load_testing.md", "0.32"): (1, "vLLM's version"),
    ("docs/deploying/monitoring.md", "0.0316"): (1, "printed by the test on the next line"),
    ("docs/deploying/monitoring.md", "2.42"): (1, "Prometheus's version"),
    ("docs/deploying/soak.md", "0.25"): (2, "budgets the soak sends"),
    ("docs/evidence/accuracy.md", "1.00"): (1, "printed by tova_per_head_check.py, next line"),
    ("docs/evidence/accuracy.md", "0.25"): (1, "the Wilson interval's width at n = 12"),
    ("docs/evidence/compat.md", "0.33"): (1, "vLLM's version"),
    ("docs/evidence/performance.md", "2x"): (1, "a target"),
    ("docs/evidence/performance.md", "8x"): (1, "batch 8 against batch 1, by construction"),
    ("docs/evidence/performance.md", "1.6x"): (3, "a target"),
    ("docs/evidence/performance.md", "0.8x"): (1, "a target"),
    ("docs/evidence/prefix_caching.md", "0.25"): (3, "a budget the arms use"),
    ("docs/evidence/prefix_caching.md", "0.13"): (2, "before the work; no file kept, it says"),
    ("docs/evidence/prefix_caching.md", "34x"): (1, "before the work; no file kept, it says"),
    ("docs/evidence/prefix_caching.md", "0.64"): (1, "a run the page says was kept outside"),
    ("docs/evidence/pressure.md", "0.25"): (2, "a budget the arms use"),
    ("docs/evidence/sessions.md", "0.05"): (1, "the sampling error's size, a reading guide"),
    ("docs/evidence/sessions.md", "1.5x"): (1, "a target"),
    ("docs/evidence/sessions.md", "0.25"): (1, "a budget the arms use"),
    ("docs/user_guide/choosing.md", "0.25"): (1, "the Wilson interval's width at n = 12"),
    ("docs/user_guide/error_target.md", "0.01"): (1, "an example target"),
    ("docs/user_guide/error_target.md", "0.03"): (1, "a target of the calibration grid"),
    ("docs/user_guide/options.md", "0.33"): (1, "vLLM's version"),
    ("docs/user_guide/server.md", "0.25"): (1, "a default setting"),
    ("docs/user_guide/sessions.md", "0.25"): (1, "a default setting"),
    ("docs/user_guide/troubleshooting.md", "0.25"): (1, "a default setting"),
}


def _untraced_figures(page: Path) -> list[tuple[int, str]]:
    """``(line, figure)`` for every measured-looking figure of ``page`` with no source."""
    found, fenced = [], False
    for n, line in enumerate(page.read_text().splitlines(), start=1):
        if line.strip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced or line.lstrip().startswith("--8<--") or COMMAND.search(line):
            continue
        text = re.sub(r"\d[\d,.]*<!--fig.*?-->", "@", line)  # an annotated figure
        text = re.sub(r"<!--.*?-->|`[^`]*`|\]\([^)]*\)", "", text)  # comments, code, link targets
        for m in MEASURED.finditer(text):
            before = text[: m.start()]
            if not re.search(r"(vLLM|Python|torch|triton|CUDA|version|v)[ -]?$", before, re.I):
                found.append((n, m.group(0)))
    return found


def test_every_measured_looking_figure_carries_its_source() -> None:
    """Ratios, figures with two decimals and decimal percentages on a user-facing page come from
    a results file (an annotation), or from the command on their line, or are listed above."""
    counts: dict[tuple[str, str], list[int]] = {}
    for page in _user_pages():
        if "reference" in page.relative_to(ROOT).parts:
            continue  # generated from the code
        for n, figure in _untraced_figures(page):
            counts.setdefault((str(page.relative_to(ROOT)), figure), []).append(n)
    unexplained = [f"{page}:{lines}: {figure}" for (page, figure), lines in sorted(counts.items())
                   if len(lines) > UNTRACED.get((page, figure), (0, ""))[0]]  # fmt: skip
    assert not unexplained, ("figures with no source (annotate them, scripts/figures.py):\n"
                             + "\n".join(unexplained))  # fmt: skip
    stale = sorted(set(UNTRACED) - set(counts))
    assert not stale, f"listed as untraced but no longer on the page: {stale}"


def test_every_annotated_figure_equals_its_source() -> None:
    """Figures carrying ``<!--fig PATH KEYS SPEC [xN]-->`` equal what their results file
    gives (scripts/figures.py --write rewrites them after a rerun)."""
    figures = _figures_module()
    assert figures.count() >= 20
    bad = figures.check()
    assert not bad, "\n".join(bad)


def test_figures_are_checked_and_rewritten_from_their_source(tmp_path: Path) -> None:
    figures = _figures_module()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text('{"a": {"x@0.1/aware": [0.8523, 3]}, "n": 1602}')
    text = ("kept 85<!--fig results/r.json a|x@0.1/aware|0 .0f x100--> % of 1,602<!--fig "
            "results/r.json n ,d--> and -0.5<!--fig results/r.json a|x@0.1/aware|1 +.1f-->")
    found = [(m["num"], want) for m, want in figures.figures(text, tmp_path)]
    assert found == [("85", "85"), ("1,602", "1,602"), ("-0.5", "+3.0")]
    fixed = figures.rewrite(text, tmp_path)
    assert "+3.0<!--fig" in fixed and "85<!--fig" in fixed
    assert all(m["num"] == want for m, want in figures.figures(fixed, tmp_path))


def test_figures_address_records_and_markdown_tables(tmp_path: Path) -> None:
    """A ``field=value&...`` key picks one record of a list; a ``.md`` source is addressed as
    ``TABLE|ROW|COLUMN[|N]`` by first cell and header (``_`` for a space) or by index."""
    figures = _figures_module()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text(
        '[{"m": "tova/attn", "b": 0.2, "acc": 0.9167}, {"m": "tova/attn", "b": 0.1, "acc": 0.5},'
        ' {"m": "h2o", "b": 0.2, "acc": 0.0}]')
    (tmp_path / "results" / "t.md").write_text(
        "title\n| config | pool blocks | prefill s |\n|---|---:|---:|\n"
        "| stock | 260 | 44.43 |\n| obcache, small pool | 1,128 | 0.92 [0.65, 0.99] |\n\n"
        "| a | b |\n|---|---|\n| x | 1.5% |\n")
    text = ("0.92<!--fig results/r.json m=tova/attn&b=0.2|acc .2f--> "
            "44.43<!--fig results/t.md 0|stock|prefill_s .2f--> "
            "1,128<!--fig results/t.md 0|obcache,_small_pool|pool_blocks ,d--> "
            "0.99<!--fig results/t.md 0|1|2|2 .2f--> 1.5<!--fig results/t.md 1|x|b .1f--> "
            "0.17<!--fig results/t.md 0|stock|prefill_s::0|stock|pool_blocks .2f--> "
            "1.83<!--fig results/r.json m=tova/attn&b=0.2|acc::m=tova/attn&b=0.1|acc .2f--> "
            "(0.50<!--fig results/r.json m=tova/attn&b=0.1|acc .2f-->-0.92<!--fig "
            "results/r.json m=tova/attn&b=0.2|acc .2f-->)")
    found = [(m["num"], want) for m, want in figures.figures(text, tmp_path)]
    assert all(num == want for num, want in found) and len(found) == 9, found
    (tmp_path / "results" / "s.json").write_text('{"stock, small pool": {"req/s": 0.236}}')
    assert figures.source_value(tmp_path, "results/s.json", "stock,_small_pool|req/s", {}) == 0.236
    records = '[{"s": {"arm": "a", "v": 1}}, {"s": {"arm": "b", "v": 2}}]'
    (tmp_path / "results" / "n.json").write_text(records)
    assert figures.source_value(tmp_path, "results/n.json", "s.arm=b|s|v", {}) == 2
    in_table = "s.arm=b\\|s\\|v"
    assert figures.source_value(tmp_path, "results/n.json", in_table, {}) == 2
    for bad in ("0<!--fig results/r.json m=tova/attn|acc .0f-->",
                "0<!--fig results/t.md 0|nope|prefill_s .0f-->"):
        with pytest.raises(KeyError):
            list(figures.figures(bad, tmp_path))


def test_figures_derive_ranges_medians_and_cross_file_ratios(tmp_path: Path) -> None:
    """A range's ends, a median of arm-for-arm ratios and a difference between two files come
    from the files too, not from a hand-computed number."""
    figures = _figures_module()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "a.json").write_text(
        '{"arms": {"x": {"kl": 0.2}, "y": {"kl": 0.5}, "z": {"kl": 0.9}}, "rows": '
        '[{"m": "p", "acc": 0.25}, {"m": "p", "acc": 0.75}, {"m": "q", "acc": 1.0}]}')
    (tmp_path / "results" / "b.json").write_text(
        '{"arms": {"x": {"kl": 0.4}, "y": {"kl": 0.5}, "z": {"kl": 3.0}}, "base": 0.1}')
    table = "| c | v |\n|---|---|\n| a | 3 |\n| b | 7 |\n| c | 9 |\n"
    (tmp_path / "results" / "t.md").write_text(table)
    value = lambda keys: figures.source_value(tmp_path, "results/a.json", keys, {})  # noqa: E731
    assert value("min:arms|*|kl") == 0.2 and value("max:arms|*|kl") == 0.9
    assert value("median:arms|*|kl::results/b.json#arms|*|kl") == 0.5  # 0.5, 1.0, 0.3
    assert value("max:arms|*|kl::results/b.json#base") == pytest.approx(9.0)
    assert value("arms|z|kl:-:results/b.json#arms|z|kl") == pytest.approx(-2.1)
    assert value("mean:rows|m=p|acc") == 0.5 and value("count:rows|*|acc") == 3
    assert value("count<0.5:rows|*|acc") == 1 and value("count>0.3:arms|*|kl") == 2
    assert value("count:rows|*|m") == 3  # counting takes any value, not only numbers
    assert figures.source_value(tmp_path, "results/t.md", "sum:0|*|v", {}) == 19
    assert figures.source_value(tmp_path, "results/t.md", "max:0|[ab]*|v", {}) == 7
    assert value("median:arms|[xy]*|kl") == pytest.approx(0.35)
    assert value("median:arms|*!z|kl") == pytest.approx(0.35)
    for bad in ("arms|*|kl", "median:arms|*|kl::results/b.json#rows|*|acc", "rows|m=p|acc"):
        with pytest.raises(KeyError):
            value(bad)
