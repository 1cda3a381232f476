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

import functools
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
    # The figures' source annotations (scripts/figures.py) are stripped by docs/hooks.py: no
    # page carries one, outside the code that shows the syntax.
    shown = [
        str(html.relative_to(site))
        for html in site.rglob("*.html")
        if re.search(r"(?:<|&lt;)!--(?:figs?\b|f\d+--)",
                     re.sub(r"<(code|pre)\b.*?</\1>", "", html.read_text(), flags=re.S))
    ]  # fmt: skip
    assert not shown, f"figure annotations left in the built pages: {shown}"


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
    # as a reader sees it: the figures' <!--figs ...--> blocks of sources (invisible) not counted
    lines = _figures_module().strip(README.read_text(encoding="utf-8")).splitlines()
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
    body = list(ast.parse(path.read_text()).body)
    for node in body:
        if isinstance(node, ast.If):  # if TYPE_CHECKING: ... else: ...
            body += node.body + node.orelse
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
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


@functools.cache
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
    ("docs/user_guide/sessions.md", "0.25"): (2, "a default setting, a budget the load sends"),
    ("docs/user_guide/sessions.md", "0.75"): (1, "a default setting"),
    ("docs/user_guide/server.md", "0.75"): (1, "a default setting"),
    ("docs/user_guide/troubleshooting.md", "0.75"): (1, "a default setting"),
    ("docs/evidence/prefix_caching.md", "0.75"): (1, "a default setting"),
    ("docs/evidence/sessions.md", "0.75"): (3, "a default setting, a share the arms use"),
    ("docs/user_guide/troubleshooting.md", "0.25"): (1, "a default setting"),
}


def _untraced_figures(page: Path) -> list[tuple[int, str]]:
    """``(line, figure)`` for every measured-looking figure of ``page`` with no source."""
    found, fenced = [], False
    # blocks of definitions (<!--figs ... -->) hold sources, not figures: blanked, lines kept
    blank = _figures_module().BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    for n, line in enumerate(blank.splitlines(), start=1):
        if line.strip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced or line.lstrip().startswith("--8<--") or COMMAND.search(line):
            continue
        text = re.sub(r"\d[\d,.]*<!--(?:fig .*?|f\d+)-->", "@", line)  # an annotated figure
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
    """Figures carrying a marker ``<!--f1-->`` defined in a block (``f1: PATH KEYS SPEC [xN]``)
    or the inline ``<!--fig PATH KEYS SPEC [xN]-->`` equal what their results file gives
    (scripts/figures.py --write rewrites them after a rerun); every marker has a definition and
    every definition a marker."""
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


def _results(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text(
        '{"a": {"x": [0.8523, 3], "y": [2.0, 5]}, "n": 1602, "k": 2}')


def test_figures_with_markers_and_blocks_are_checked_and_rewritten(tmp_path: Path) -> None:
    """A marker ``<!--f1-->`` after the figure, its source in the ``<!--figs`` block at the end
    of the paragraph, or after the table (a blank line between) whose row holds the figure."""
    figures = _figures_module()
    _results(tmp_path)
    text = ("Kept 85<!--f1--> % of 1,602<!--f2--> tokens, -0.5<!--f3--> off.\n<!--figs\n"
            "f1: results/r.json a|x|0 .0f x100\nf2: results/r.json n ,d\n"
            "f3: results/r.json a|x|1 +.1f\n-->\n\n| arm | kept |\n|---|---|\n| x | 3<!--f4--> |\n"
            "\n<!--figs\nf4: results/r.json a|x|1 d\n-->\n")  # fmt: skip
    found = [(f.num, want, f.id) for f, want in figures.figures(text, tmp_path)]
    assert found == [("85", "85", "f1"), ("1,602", "1,602", "f2"), ("-0.5", "+3.0", "f3"),
                     ("3", "3", "f4")]  # fmt: skip
    fixed = figures.rewrite(text, tmp_path)
    assert fixed == text.replace("-0.5<!--f3-->", "+3.0<!--f3-->")
    assert figures.strip(fixed) == ("Kept 85 % of 1,602 tokens, +3.0 off.\n\n"
                                    "| arm | kept |\n|---|---|\n| x | 3 |\n\n")  # fmt: skip
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(fixed)
    (tmp_path / "docs" / "p.md").write_text(text)
    assert figures.check(tmp_path) == [
        "docs/p.md:1: -0.5 but results/r.json a|x|1 gives +3.0"]
    assert figures.count(tmp_path) == 8


def test_a_marker_or_a_definition_without_its_counterpart_is_an_error(tmp_path: Path) -> None:
    figures = _figures_module()
    _results(tmp_path)
    define = "<!--figs\nf1: results/r.json k d\n"
    cases = {
        f"2<!--f1--> and 2<!--f2-->\n{define}-->\n": "marker f2 has no definition",
        f"2<!--f1-->\n{define}f2: results/r.json k d\n-->\n": "definition f2 marks no figure",
        f"2<!--f1--> and 2<!--f1-->\n{define}-->\n": "f1 marks two figures",
        f"2<!--f1-->\n{define}f1: results/r.json k d\n-->\n": "f1 is defined twice",
        "2<!--f1-->\n<!--figs\nf1: results/r.json n\n-->\n": "not a definition",
        f"two<!--f1-->\n{define}-->\n": "marker f1 follows no number",
        "2<!--fig results/r.json-->\n": "unreadable annotation",
        "2<!--figs f1: results/r.json k d-->\n": "unreadable annotation",
    }
    for text, problem in cases.items():
        _, errors = figures.parse(text)
        assert any(problem in msg for _, msg in errors), (text, errors)
        with pytest.raises(ValueError, match=problem):
            figures.rewrite(text, tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("Nothing measured.\n")
    (tmp_path / "docs" / "p.md").write_text(f"# P\n\n2<!--f1--> and 2<!--f2-->\n{define}-->\n")
    assert figures.check(tmp_path) == [
        "docs/p.md:3: marker f2 has no definition in a <!--figs block"]
    # Code shows the syntax without being a figure.
    assert figures.parse("`1.8<!--f1-->x` and\n```\n2<!--f2-->\n```\n") == ([], [])


SAMPLE_PAGE = """# Page

The run kept 85<!--fig results/r.json a|x|0 .0f x100--> % of
the 1,602<!--fig results/r.json n ,d--> tokens, a range 0.85<!--fig results/r.json min:a|*|0 .2f-->-5<!--fig
results/r.json max:a|*|1 d--> (the syntax: `1<!--fig results/r.json n d-->`).

- first item 3<!--fig results/r.json a|x|1 d-->
  goes on
- second item, no figure
    - nested 1,602<!--fig results/r.json n ,d-->x

!!! note "A run"
    An admonition: 2.0<!--fig results/r.json a|y|0 .1f-->x.

| arm | kept | n |
|---|---|---|
| x | 85<!--fig results/r.json a\\|x\\|0 .0f x100--> % | 3<!--fig results/r.json a\\|x\\|1 d--> |
Closing.

```text
2<!--fig results/r.json n d--> in a fence stays
```
"""  # noqa: E501

CONVERTED_PAGE = """# Page

The run kept 85<!--f1--> % of
the 1,602<!--f2--> tokens, a range 0.85<!--f3-->-5<!--f4--> (the syntax: `1<!--fig results/r.json n d-->`).
<!--figs
f1: results/r.json a|x|0 .0f x100
f2: results/r.json n ,d
f3: results/r.json min:a|*|0 .2f
f4: results/r.json max:a|*|1 d
-->

- first item 3<!--f5-->
  goes on
  <!--figs
  f5: results/r.json a|x|1 d
  -->
- second item, no figure
    - nested 1,602<!--f6-->x
      <!--figs
      f6: results/r.json n ,d
      -->

!!! note "A run"
    An admonition: 2.0<!--f7-->x.
    <!--figs
    f7: results/r.json a|y|0 .1f
    -->

| arm | kept | n |
|---|---|---|
| x | 85<!--f8--> % | 3<!--f9--> |
Closing.

<!--figs
f8: results/r.json a|x|0 .0f x100
f9: results/r.json a|x|1 d
-->

```text
2<!--fig results/r.json n d--> in a fence stays
```
"""  # noqa: E501


def test_convert_moves_inline_sources_into_blocks_and_changes_nothing_else(tmp_path: Path) -> None:
    """``--convert``: each inline source becomes a marker and a definition in the block of its
    paragraph, list item (indented to stay in it), admonition or table (after it, ``\\|`` no
    longer escaped); the figures check exactly as before, the prose reads the same, code keeps
    its examples, and converting again changes nothing."""
    figures = _figures_module()
    _results(tmp_path)
    converted = figures.convert(SAMPLE_PAGE)
    assert converted == CONVERTED_PAGE
    assert figures.convert(converted) == converted
    before = [(f.num, want) for f, want in figures.figures(SAMPLE_PAGE, tmp_path)]
    after = [(f.num, want) for f, want in figures.figures(converted, tmp_path)]
    assert before == after and len(after) == 9
    assert all(num == want for num, want in after)
    blank_runs = lambda text: re.sub(r"\n\n+", "\n\n", text)  # noqa: E731
    assert blank_runs(figures.strip(converted)) == blank_runs(figures.strip(SAMPLE_PAGE))
    # A page mid-edit: a new inline figure in a converted paragraph joins that paragraph's block
    # under the next free id; both forms check side by side.
    edited = converted.replace("goes on\n", "goes on, 1,602<!--fig results/r.json n ,d-->\n")
    assert [f.id for f, _ in figures.figures(edited, tmp_path)].count(None) == 1
    again = figures.convert(edited)
    assert "goes on, 1,602<!--f10-->\n  <!--figs\n  f5: results/r.json a|x|1 d\n" \
           "  f10: results/r.json n ,d\n  -->\n" in again
    assert not figures.parse(again)[1] and len(list(figures.figures(again, tmp_path))) == 10


def test_the_readme_options_table_lists_every_option_with_its_built_in_default() -> None:
    """The README's one-screen options table is a summary of ``obcache_vllm.options.OPTIONS``
    (the REST reference is generated from them): every request field is in it, and its
    "built-in default" cell names the option's default, so the summary cannot drift."""
    from obcache_vllm.options import OPTIONS, REQUIRED

    text = README.read_text(encoding="utf-8")
    table = text[text.index("## Options"):text.index("## What it does")]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for name in re.findall(r"`(kv_\w+)`", cells[0]):
                rows[name] = cells[2]
    missing = [spec.field for spec in OPTIONS if spec.field not in rows]
    assert not missing, f"README's options table lacks {missing}"

    def shown(value) -> str:
        if value is REQUIRED or value is None:
            return ""
        if isinstance(value, bool):
            return str(value).lower()
        return str(value)

    wrong = []
    for spec in OPTIONS:
        expected = shown(spec.default)
        if expected and expected not in rows[spec.field]:
            wrong.append(f"{spec.field}: README says {rows[spec.field]!r}, the default is "
                         f"{spec.default!r}")  # fmt: skip
    assert not wrong, "\n".join(wrong)
